# Builds the `palisade` binary; used by docker-compose.yml.
FROM rust:1.95-bookworm AS build
# cmake: librdkafka. (No protoc: etcd-client's protos are compiled by
# protox, docs/decisions/0014-vendored-etcd-client.md.)
RUN apt-get update && apt-get install -y --no-install-recommends cmake \
    && rm -rf /var/lib/apt/lists/*
WORKDIR /src
COPY . .
RUN cargo build --release --bin palisade

FROM debian:bookworm-slim
# curl: the HTTPS health check of docker-compose.secure.yml.
RUN apt-get update && apt-get install -y --no-install-recommends curl ca-certificates \
    && rm -rf /var/lib/apt/lists/*
COPY --from=build /src/target/release/palisade /usr/local/bin/palisade
VOLUME /data
EXPOSE 7070
ENTRYPOINT ["palisade", "serve", "--data", "/data", "--listen", "0.0.0.0:7070"]
