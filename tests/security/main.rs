//! Authentication, authorization, TLS, limits and audit over real HTTP (in progress).
