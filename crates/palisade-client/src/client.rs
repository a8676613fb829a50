//! [`Client`]: one method per endpoint the SDK covers.

use std::time::Duration;

use palisade_api::{ErrorName, LeaseIn};
use palisade_core::Purpose;
use reqwest::{Method, Url};
use serde::Serialize;

use crate::error::{from_response, ClientError};
use crate::lease::{Lease, LeaseOptions};
use crate::types::{
    Appended, Event, EventsPage, LeaseAdvice, LeaseGrant, OutboxEntry, OutboxResponse, Partitions,
    Refusal, RefusalsResponse, StoredEvent, TwinState,
};
use crate::watch::{EventStream, WatchFrom, WATCH_IDLE_TIMEOUT};

/// How long establishing a connection may take.
pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(3);
/// How long a whole request may take (an append waits for its batch to be on disk).
pub const REQUEST_TIMEOUT: Duration = Duration::from_secs(30);
/// Most attempts of one idempotent append (the first one included).
pub const APPEND_ATTEMPTS: u32 = 3;
/// Wait before the second attempt; doubled before the third.
pub const APPEND_BACKOFF: Duration = Duration::from_millis(50);

/// Most `307`/`308` redirects one call follows (a cluster answers a
/// request for a twin another node owns with one, to that node).
pub const MAX_REDIRECTS: usize = 5;

/// A client of one Palisade store (or of any node of a cluster). Cheap to
/// clone (clones share connections).
#[derive(Debug, Clone)]
pub struct Client {
    base: Url,
    http: reqwest::Client,
    /// `Authorization: Bearer <key>` for every request, marked sensitive
    /// (not shown by `Debug`).
    auth: Option<reqwest::header::HeaderValue>,
}

impl Client {
    /// A client for the store at `base_url` (e.g. `http://127.0.0.1:7070`),
    /// with [`CONNECT_TIMEOUT`] and [`REQUEST_TIMEOUT`]. It follows a
    /// cluster's redirects itself (up to [`MAX_REDIRECTS`]), with the same
    /// method, body and headers, the [`Client::with_api_key`] key included.
    pub fn new(base_url: &str) -> Result<Self, ClientError> {
        let http = reqwest::Client::builder()
            .connect_timeout(CONNECT_TIMEOUT)
            .timeout(REQUEST_TIMEOUT)
            .redirect(reqwest::redirect::Policy::none())
            .build()?;
        Self::with_http_client(base_url, http)
    }

    /// This client, sending `Authorization: Bearer <api_key>` with every
    /// request (a store with authentication on, docs/security.md). The key
    /// goes along when the client follows a cluster's redirect to another
    /// node, but only to an `https://` URL or to the host it was sent to.
    pub fn with_api_key(mut self, api_key: &str) -> Result<Self, ClientError> {
        let mut v = reqwest::header::HeaderValue::from_str(&format!("Bearer {}", api_key.trim()))
            .map_err(|_| {
            ClientError::BadUrl("the API key is not a valid header value".into())
        })?;
        v.set_sensitive(true);
        self.auth = Some(v);
        Ok(self)
    }

    /// A client over your own `reqwest::Client` (your timeouts, proxies,
    /// TLS). Build it with `redirect(Policy::none())` to have this client
    /// follow a cluster's redirects keeping your key; reqwest's own policy
    /// drops `Authorization` on a redirect to another host or port.
    pub fn with_http_client(base_url: &str, http: reqwest::Client) -> Result<Self, ClientError> {
        let mut base =
            Url::parse(base_url).map_err(|e| ClientError::BadUrl(format!("{base_url:?}: {e}")))?;
        if !matches!(base.scheme(), "http" | "https") {
            return Err(ClientError::BadUrl(format!(
                "{base_url:?}: the scheme must be http or https"
            )));
        }
        if base.cannot_be_a_base() || base.host().is_none() {
            return Err(ClientError::BadUrl(format!("{base_url:?}: no host")));
        }
        base.set_query(None);
        base.set_fragment(None);
        Ok(Self {
            base,
            http,
            auth: None,
        })
    }

    /// The store's base URL.
    pub fn base_url(&self) -> &Url {
        &self.base
    }

    /// The URL of `segments` under the base; each segment is percent-encoded
    /// (a twin id may contain `/`, spaces, anything printable).
    fn url(&self, segments: &[&str]) -> Result<Url, ClientError> {
        let mut url = self.base.clone();
        url.path_segments_mut()
            .map_err(|()| ClientError::BadUrl(self.base.to_string()))?
            .pop_if_empty()
            .extend(segments);
        Ok(url)
    }

    /// Send a request, following `307`/`308` redirects (a cluster node
    /// sends a request for a twin another node owns there); a non-2xx
    /// response becomes the matching error.
    async fn send(&self, req: reqwest::RequestBuilder) -> Result<reqwest::Response, ClientError> {
        let mut request = req.build()?;
        if let Some(auth) = &self.auth {
            request
                .headers_mut()
                .insert(reqwest::header::AUTHORIZATION, auth.clone());
        }
        let mut hops = 0;
        let resp = loop {
            // A body that cannot be cloned (a stream) is not re-sent.
            let again = request.try_clone();
            let from = request.url().clone();
            let resp = self.http.execute(request).await?;
            let redirect = matches!(resp.status().as_u16(), 307 | 308);
            let to = resp
                .headers()
                .get(reqwest::header::LOCATION)
                .and_then(|l| l.to_str().ok())
                .and_then(|l| from.join(l).ok());
            match (redirect && hops < MAX_REDIRECTS, again, to) {
                (true, Some(mut next), Some(to)) => {
                    hops += 1;
                    let keeps_key = to.scheme() == "https" || to.host() == from.host();
                    if !keeps_key {
                        next.headers_mut().remove(reqwest::header::AUTHORIZATION);
                    }
                    *next.url_mut() = to;
                    request = next;
                }
                _ => break resp,
            }
        };
        let status = resp.status();
        if status.is_success() {
            return Ok(resp);
        }
        let body = resp.bytes().await?;
        Err(from_response(status.as_u16(), &body))
    }

    async fn json<T: serde::de::DeserializeOwned>(
        &self,
        method: Method,
        segments: &[&str],
        body: Option<&(impl Serialize + ?Sized)>,
    ) -> Result<T, ClientError> {
        let mut req = self.http.request(method, self.url(segments)?);
        if let Some(b) = body {
            req = req.json(b);
        }
        Ok(self.send(req).await?.json().await?)
    }

    /// Take a lease on `scope` (`partition/<p>` or `twin/<id>`) for `ttl`
    /// (100 ms to 24 h, whole milliseconds). One request: nothing renews it.
    ///
    /// `Err(LeaseHeld)` while another holder's lease is live. The same holder
    /// acquiring again gets a new lease and token; its old lease is superseded.
    pub async fn acquire(
        &self,
        scope: &str,
        holder: &str,
        ttl: Duration,
    ) -> Result<LeaseGrant, ClientError> {
        self.acquire_for(scope, holder, ttl, None).await
    }

    /// [`Client::acquire`] naming what the lease is for:
    /// [`Purpose::Correctness`] (the store's default) or
    /// [`Purpose::Efficiency`]. Both are fenced alike by the store; the
    /// purpose is shown in the lease, its metrics and the audit log
    /// (docs/decisions/0028-lease-purpose.md).
    pub async fn acquire_with_purpose(
        &self,
        scope: &str,
        holder: &str,
        ttl: Duration,
        purpose: Purpose,
    ) -> Result<LeaseGrant, ClientError> {
        self.acquire_for(scope, holder, ttl, Some(purpose)).await
    }

    pub(crate) async fn acquire_for(
        &self,
        scope: &str,
        holder: &str,
        ttl: Duration,
        purpose: Option<Purpose>,
    ) -> Result<LeaseGrant, ClientError> {
        let ttl_ms = u64::try_from(ttl.as_millis()).unwrap_or(u64::MAX);
        let body = LeaseIn {
            scope: scope.to_owned(),
            holder: holder.to_owned(),
            ttl_ms,
            purpose,
        };
        self.json(Method::POST, &["v1", "leases"], Some(&body))
            .await
    }

    /// Restart a lease's TTL. `Err(LeaseGone)` once it expired, was
    /// superseded or released.
    pub async fn renew(&self, lease_id: &str) -> Result<LeaseGrant, ClientError> {
        self.json(
            Method::POST,
            &["v1", "leases", lease_id, "renew"],
            None::<&()>,
        )
        .await
    }

    /// Release a lease so the scope can be granted at once.
    pub async fn release(&self, lease_id: &str) -> Result<(), ClientError> {
        let req = self.http.delete(self.url(&["v1", "leases", lease_id])?);
        self.send(req).await?;
        Ok(())
    }

    /// Take a lease and keep it renewed in the background until the returned
    /// guard is dropped or released. See [`Lease`] for what `lost()` does and
    /// does not promise.
    pub async fn lease(
        &self,
        scope: &str,
        holder: &str,
        ttl: Duration,
        opts: LeaseOptions,
    ) -> Result<Lease, ClientError> {
        Lease::acquire(self.clone(), scope, holder, ttl, opts).await
    }

    /// Append `events` to `twin` under fencing token `token`, all or none.
    ///
    /// Retries: only when **every** event has an `event_id` (the store then
    /// dedupes a batch that did land), and only on transport failures
    /// (connect, timeout, connection dropped), at most [`APPEND_ATTEMPTS`]
    /// attempts with a short backoff. A response with any HTTP status is
    /// never retried. Without ids a transport error is returned as is: the
    /// batch may or may not have been stored; read the twin's events to tell.
    ///
    /// After a retry, an error can hide an earlier attempt that did land
    /// (e.g. `Stale` because another lease was granted in between); the
    /// events' ids tell which.
    pub async fn append(
        &self,
        twin: &str,
        token: u64,
        events: &[Event],
    ) -> Result<Appended, ClientError> {
        let idempotent = !events.is_empty() && events.iter().all(|e| e.event_id.is_some());
        let mut attempt = 1;
        loop {
            match self.append_once(twin, token, None, events).await {
                Err(ClientError::Transport(e))
                    if idempotent && attempt < APPEND_ATTEMPTS && retryable(&e) =>
                {
                    let wait = APPEND_BACKOFF * 2u32.pow(attempt - 1);
                    tracing::debug!(twin, token, attempt, error = %e, ?wait, "retrying idempotent append");
                    tokio::time::sleep(wait).await;
                    attempt += 1;
                }
                other => return other,
            }
        }
    }

    /// Append only if the twin's version (its ETag) is still `version`;
    /// otherwise `Api { status: 412, error: "version_mismatch", .. }`.
    ///
    /// Never retried, even with event ids: the store checks the version
    /// before it dedupes, so a retry of a batch that did land would report
    /// `version_mismatch` rather than `duplicates`.
    pub async fn append_if_match(
        &self,
        twin: &str,
        token: u64,
        version: u64,
        events: &[Event],
    ) -> Result<Appended, ClientError> {
        self.append_once(twin, token, Some(version), events).await
    }

    async fn append_once(
        &self,
        twin: &str,
        token: u64,
        if_match: Option<u64>,
        events: &[Event],
    ) -> Result<Appended, ClientError> {
        let mut req = self
            .http
            .post(self.url(&["v1", "twins", twin, "events"])?)
            .header("fencing-token", token.to_string())
            .json(events);
        if let Some(v) = if_match {
            req = req.header(reqwest::header::IF_MATCH, format!("\"{v}\""));
        }
        Ok(self.send(req).await?.json().await?)
    }

    /// The twin's current state; `None` if it has no events.
    ///
    /// For device-shadow documents (a `desired` and a `reported` section)
    /// the store also computes [`TwinState::delta`].
    pub async fn twin(&self, twin: &str) -> Result<Option<TwinState>, ClientError> {
        self.twin_as_of(twin, None).await
    }

    /// The twin's state after its events up to partition seq `seq`
    /// (`?at_seq=`); `None` if it had no events by then. `version` is the
    /// seq of the latest event included; `fence` is always the current fence.
    ///
    /// ```no_run
    /// # async fn run(client: palisade_client::Client) -> Result<(), palisade_client::ClientError> {
    /// let events = client.events("pump-7", 0, 10).await?;
    /// // The state right after the first event, whatever came later.
    /// let then = client.twin_at_seq("pump-7", events[0].seq).await?;
    /// # Ok(())
    /// # }
    /// ```
    pub async fn twin_at_seq(
        &self,
        twin: &str,
        seq: u64,
    ) -> Result<Option<TwinState>, ClientError> {
        self.twin_as_of(twin, Some(("at_seq", seq.to_string())))
            .await
    }

    /// The twin's state from its events with HLC ≤ `hlc` (`?at_hlc=`), in
    /// HLC order, not arrival order; `None` if it had none by then. `hlc` is
    /// a [`Hlc`](palisade_core::Hlc) or its text form `<ntp64>/<hex id>`, e.g.
    /// a [`StoredEvent::hlc`]; other text is `Api { status: 400, error:
    /// "bad_hlc", .. }`.
    pub async fn twin_at_hlc(
        &self,
        twin: &str,
        hlc: impl std::fmt::Display,
    ) -> Result<Option<TwinState>, ClientError> {
        self.twin_as_of(twin, Some(("at_hlc", hlc.to_string())))
            .await
    }

    async fn twin_as_of(
        &self,
        twin: &str,
        at: Option<(&str, String)>,
    ) -> Result<Option<TwinState>, ClientError> {
        let mut url = self.url(&["v1", "twins", twin])?;
        if let Some((k, v)) = at {
            url.query_pairs_mut().append_pair(k, &v);
        }
        match self.send(self.http.get(url)).await {
            Ok(resp) => Ok(Some(resp.json().await?)),
            Err(e @ ClientError::Api { status: 404, .. })
                if e.name() == Some(ErrorName::TwinNotFound) =>
            {
                Ok(None)
            }
            Err(e) => Err(e),
        }
    }

    /// Every partition: its fence, head (latest seq) and live
    /// `partition/<p>` lease, and the last token the store issued. With
    /// authentication on this needs `read` on `admin/partitions`.
    pub async fn partitions(&self) -> Result<Partitions, ClientError> {
        self.json(Method::GET, &["v1", "partitions"], None::<&()>)
            .await
    }

    /// A live stream of the twin's events as they are appended
    /// (`GET /v1/twins/{id}/watch`, Server-Sent Events). See [`EventStream`]
    /// for what it yields and how it ends.
    ///
    /// ```no_run
    /// use futures_util::StreamExt;
    /// use palisade_client::{Client, ClientError, WatchFrom};
    ///
    /// # async fn run(client: Client) -> Result<(), ClientError> {
    /// let mut from = WatchFrom::After(0); // the whole history, then live
    /// loop {
    ///     let mut events = client.watch_twin("pump-7", from).await?;
    ///     while let Some(item) = events.next().await {
    ///         match item {
    ///             Ok(ev) => println!("{} {}", ev.seq, ev.patch),
    ///             Err(e) => eprintln!("{e}"),
    ///         }
    ///     }
    ///     // Broken or closed: carry on after the last event seen.
    ///     from = events.resume_from();
    /// }
    /// # }
    /// ```
    pub async fn watch_twin(
        &self,
        twin: &str,
        from: WatchFrom,
    ) -> Result<EventStream, ClientError> {
        self.watch(&["v1", "twins", twin, "watch"], from).await
    }

    /// A live stream of every event appended to partition `partition`
    /// (`GET /v1/partitions/{p}/watch`), as [`watch_twin`](Self::watch_twin).
    /// `Api { status: 404, error: "unknown_partition", .. }` if the store has
    /// no such partition.
    pub async fn watch_partition(
        &self,
        partition: u32,
        from: WatchFrom,
    ) -> Result<EventStream, ClientError> {
        let p = partition.to_string();
        self.watch(&["v1", "partitions", &p, "watch"], from).await
    }

    async fn watch(&self, segments: &[&str], from: WatchFrom) -> Result<EventStream, ClientError> {
        // The client's whole-request timeout would cut an endless stream:
        // lift it for this request; the idle timeout bounds it instead.
        let mut req = self
            .http
            .get(self.url(segments)?)
            .header(reqwest::header::ACCEPT, "text/event-stream")
            .timeout(Duration::MAX);
        if let WatchFrom::After(seq) = from {
            req = req.header("last-event-id", seq.to_string());
        }
        let resp = tokio::time::timeout(WATCH_IDLE_TIMEOUT, self.send(req))
            .await
            .map_err(|_| ClientError::Stream {
                error: "idle_timeout".to_owned(),
                message: format!("no response within {WATCH_IDLE_TIMEOUT:?}"),
            })??;
        Ok(EventStream::new(resp, from))
    }

    /// Up to `limit` of the twin's events with partition seq above `after`,
    /// oldest first (the server caps `limit`, by default at 1000). Page on by
    /// passing the last event's `seq` as `after`.
    pub async fn events(
        &self,
        twin: &str,
        after: u64,
        limit: usize,
    ) -> Result<Vec<StoredEvent>, ClientError> {
        let mut url = self.url(&["v1", "twins", twin, "events"])?;
        url.query_pairs_mut()
            .append_pair("after", &after.to_string())
            .append_pair("limit", &limit.to_string());
        let page: EventsPage = self.send(self.http.get(url)).await?.json().await?;
        Ok(page.events)
    }

    /// Up to `limit` of the twin's refused writes from the store's durable
    /// refusal journal, newest first (the server caps `limit` at 1024 and
    /// refuses 0): stale tokens, tokens never issued or of another scope,
    /// over HTTP and Kafka. An unknown twin has none.
    pub async fn twin_refusals(
        &self,
        twin: &str,
        limit: usize,
    ) -> Result<Vec<Refusal>, ClientError> {
        self.refusals(&["v1", "twins", twin, "refusals"], limit)
            .await
    }

    /// Up to `limit` of partition `partition`'s refused writes, newest
    /// first, as [`twin_refusals`](Self::twin_refusals).
    pub async fn partition_refusals(
        &self,
        partition: u32,
        limit: usize,
    ) -> Result<Vec<Refusal>, ClientError> {
        let p = partition.to_string();
        self.refusals(&["v1", "partitions", &p, "refusals"], limit)
            .await
    }

    /// Up to `limit` effects of admitted events from the store's fenced
    /// outbox (`docs/outbox.md`), in order of partition, seq and effect
    /// index, only those in `state` (`pending`, `delivered`, `dead`) if
    /// given. Needs `admin` on `admin/outbox` with authentication on.
    pub async fn outbox(
        &self,
        state: Option<&str>,
        limit: usize,
    ) -> Result<Vec<OutboxEntry>, ClientError> {
        let mut url = self.url(&["v1", "outbox"])?;
        url.query_pairs_mut()
            .append_pair("limit", &limit.to_string());
        if let Some(s) = state {
            url.query_pairs_mut().append_pair("state", s);
        }
        let page: OutboxResponse = self.send(self.http.get(url)).await?.json().await?;
        Ok(page.effects)
    }

    /// Remove a dead effect (one that failed every try) from the outbox,
    /// once it has been dealt with; by the `partition`, `seq` and `index`
    /// [`Client::outbox`] lists. Pending and delivered effects are refused
    /// (`outbox_effect_not_dead`); single node only. Needs `admin` on
    /// `admin/outbox` with authentication on.
    pub async fn outbox_remove_dead(
        &self,
        partition: u32,
        seq: u64,
        index: u16,
    ) -> Result<(), ClientError> {
        let (p, s, i) = (partition.to_string(), seq.to_string(), index.to_string());
        let req = self.http.delete(self.url(&["v1", "outbox", &p, &s, &i])?);
        self.send(req).await?;
        Ok(())
    }

    async fn refusals(&self, segments: &[&str], limit: usize) -> Result<Vec<Refusal>, ClientError> {
        let mut url = self.url(segments)?;
        url.query_pairs_mut()
            .append_pair("limit", &limit.to_string());
        let page: RefusalsResponse = self.send(self.http.get(url)).await?.json().await?;
        Ok(page.refusals)
    }

    /// The TTL the store recommends for `scope` from the renewal gaps and
    /// answer latencies it measured (every holder's, or only `holder`'s):
    /// `recommended_ttl_ms` is `None` until it has seen 20 renewal gaps.
    /// See [`Client::lease_with_advice`] and docs/decisions/0026-ttl-advice.md.
    pub async fn lease_advice(
        &self,
        scope: &str,
        holder: Option<&str>,
    ) -> Result<LeaseAdvice, ClientError> {
        let mut url = self.url(&["v1", "leases", "advice"])?;
        url.query_pairs_mut().append_pair("scope", scope);
        if let Some(h) = holder {
            url.query_pairs_mut().append_pair("holder", h);
        }
        Ok(self.send(self.http.get(url)).await?.json().await?)
    }

    /// [`Client::lease`] with the TTL the store recommends for `scope`
    /// ([`Client::lease_advice`]), or `fallback` while it has no
    /// recommendation yet. The renewal period stays a third of the TTL
    /// unless `opts` says otherwise.
    pub async fn lease_with_advice(
        &self,
        scope: &str,
        holder: &str,
        fallback: Duration,
        opts: LeaseOptions,
    ) -> Result<Lease, ClientError> {
        let advice = self.lease_advice(scope, None).await?;
        let ttl = advice
            .recommended_ttl_ms
            .map_or(fallback, Duration::from_millis);
        self.lease(scope, holder, ttl, opts).await
    }
}

/// Transport failures after which an idempotent request may be sent again:
/// no connection, a timeout, or the connection failing mid-request. Not
/// builder, redirect or decode errors (a response did arrive).
fn retryable(e: &reqwest::Error) -> bool {
    e.is_connect() || e.is_timeout() || (e.is_request() && !e.is_builder())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn base_urls() {
        assert!(matches!(
            Client::new("not a url"),
            Err(ClientError::BadUrl(_))
        ));
        assert!(matches!(
            Client::new("ftp://x/"),
            Err(ClientError::BadUrl(_))
        ));
        assert!(matches!(
            Client::new("mailto:a@b"),
            Err(ClientError::BadUrl(_))
        ));
        let c = Client::new("http://127.0.0.1:7070").unwrap();
        assert_eq!(
            c.url(&["v1", "twins", "a/b c?", "events"])
                .unwrap()
                .as_str(),
            "http://127.0.0.1:7070/v1/twins/a%2Fb%20c%3F/events"
        );
        // A path prefix (behind a proxy) is kept, with or without a slash.
        for base in ["http://h/palisade", "http://h/palisade/?x=1"] {
            let c = Client::new(base).unwrap();
            assert_eq!(
                c.url(&["v1", "leases"]).unwrap().as_str(),
                "http://h/palisade/v1/leases"
            );
        }
    }
}
