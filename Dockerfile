# Builds the `palisade` binary; used by docker-compose.yml.
FROM rust:1.95-bookworm AS build
# protoc: etcd-client's build compiles etcd's .proto files
# (docs/decisions/0011-etcd-lease-authority.md); cmake: librdkafka.
RUN apt-get update && apt-get install -y --no-install-recommends protobuf-compiler cmake \
    && rm -rf /var/lib/apt/lists/*
WORKDIR /src
COPY . .
RUN cargo build --release --bin palisade

FROM debian:bookworm-slim
COPY --from=build /src/target/release/palisade /usr/local/bin/palisade
VOLUME /data
EXPOSE 7070
ENTRYPOINT ["palisade", "serve", "--data", "/data", "--listen", "0.0.0.0:7070"]
