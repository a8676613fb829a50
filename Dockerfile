# Builds the `palisade` binary; used by docker-compose.yml.
FROM rust:1.95-bookworm AS build
WORKDIR /src
COPY . .
RUN cargo build --release --bin palisade

FROM debian:bookworm-slim
COPY --from=build /src/target/release/palisade /usr/local/bin/palisade
VOLUME /data
EXPOSE 7070
ENTRYPOINT ["palisade", "serve", "--data", "/data", "--listen", "0.0.0.0:7070"]
