#!/usr/bin/env python3
"""A Palisade worker in Python: one twin, one lease, events through Kafka.

It takes a lease on `twin/<id>` over HTTP, publishes the twin's events to
the ingest topic with confluent-kafka (a JSON or a protobuf record value,
the fencing token in a header), renews the lease in between, and stops as
soon as a renewal fails. At the end it reads the twin back over HTTP.

The store is the safety net, not this loop: a record that reaches the store
after someone else was granted the twin is dropped there, whatever this
program does. Stopping on lease loss only keeps a stale worker from adding
records that are bound to be dropped (docs/kafka.md, "What happens to a
record"). See README.md for how to run it.

Exit codes: 0 done (every event applied, lease released), 1 an error,
2 a usage error, 3 the lease was lost: the worker stopped, 4 the lease is
held by someone else (without --wait-for-lease).
"""

import argparse
import json
import signal
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

EXIT_OK, EXIT_ERROR, EXIT_LOST, EXIT_HELD = 0, 1, 3, 4


def log(*parts):
    # One line per step, flushed at once: a supervisor (or the test that runs
    # this example) follows the worker's progress line by line.
    print(*parts, flush=True)


class LeaseLost(Exception):
    """The store said the lease is gone (410/404), or it could not be renewed before it expired."""


class FollowOwnerRedirects(urllib.request.HTTPRedirectHandler):
    """Follow 307/308 for every method, with the same body and headers.

    In cluster mode a node answers a request for a twin it does not own with
    a 307 to the owner (README, "Several nodes"). urllib follows redirects
    of GET only; a lease request or a renewal is a POST and must be sent
    again, unchanged, to the owner.
    """

    def redirect_request(self, req, fp, code, msg, headers, newurl):
        if code in (307, 308):
            # req.headers: the headers the worker set (not Host, which
            # urllib adds for each hop).
            return urllib.request.Request(newurl, data=req.data, headers=dict(req.headers), method=req.get_method())
        return super().redirect_request(req, fp, code, msg, headers, newurl)


class Store:
    """The three HTTP calls a worker needs, with the standard library only."""

    def __init__(self, url, timeout_s=10.0):
        self.url = url.rstrip("/")
        self.timeout_s = timeout_s
        self.opener = urllib.request.build_opener(FollowOwnerRedirects)

    def call(self, method, path, body=None):
        """(status, JSON body or None). Error statuses are answers, not exceptions."""
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.url + path, data=data, method=method)
        if data is not None:
            req.add_header("content-type", "application/json")
        try:
            with self.opener.open(req, timeout=self.timeout_s) as r:
                status, raw = r.status, r.read()
        except urllib.error.HTTPError as e:
            status, raw = e.code, e.read()
        try:
            return status, json.loads(raw) if raw else None
        except ValueError:
            return status, None

    def acquire(self, twin, holder, ttl_ms):
        return self.call("POST", "/v1/leases", {"scope": f"twin/{twin}", "holder": holder, "ttl_ms": ttl_ms})

    def renew(self, lease_id):
        return self.call("POST", f"/v1/leases/{lease_id}/renew")

    def release(self, lease_id):
        return self.call("DELETE", f"/v1/leases/{lease_id}")

    def twin(self, twin):
        return self.call("GET", f"/v1/twins/{quote(twin)}")

    def twin_events(self, twin, after):
        return self.call("GET", f"/v1/twins/{quote(twin)}/events?after={after}&limit=1000")

    def partition_head(self, partition):
        status, body = self.call("GET", "/v1/partitions")
        if status != 200:
            raise RuntimeError(f"GET /v1/partitions: {status} {body}")
        return next(p["head"] for p in body["partitions"] if p["partition"] == partition)


def quote(twin):
    return urllib.parse.quote(twin, safe="")


class Lease:
    """A held lease: renews when due, and knows when it may be gone.

    `deadline` is when the lease ends if no renewal succeeds, measured from
    the moment the last successful request was *sent* (the store started its
    TTL no earlier), so the local view never outlives the store's.
    """

    def __init__(self, store, grant, renew_every_s, sent_at):
        self.store = store
        self.lease_id = grant["lease_id"]
        self.token = grant["token"]
        self.ttl_s = grant["ttl_ms"] / 1000
        self.renew_every_s = renew_every_s
        self.deadline = sent_at + self.ttl_s
        self.next_renew = sent_at + renew_every_s

    def renew_if_due(self, now):
        if now < self.next_renew:
            return
        sent_at = time.monotonic()
        try:
            status, body = self.store.renew(self.lease_id)
        except OSError as e:
            # The store is unreachable: keep trying until the lease would
            # have run out, then assume it is lost.
            if time.monotonic() >= self.deadline:
                raise LeaseLost(f"unreachable until the lease ran out ({e})") from e
            self.next_renew = time.monotonic() + min(1.0, self.renew_every_s)
            log(f"renew failed ({e}); retrying")
            return
        if status == 200:
            self.deadline = sent_at + body["ttl_ms"] / 1000
            self.next_renew = sent_at + self.renew_every_s
            log(f"renewed lease_id={self.lease_id} expires_in_ms={body['expires_in_ms']}")
        elif status in (404, 410):
            raise LeaseLost((body or {}).get("error", str(status)))
        else:
            # 5xx and the like: the lease may still be ours; retry until it ends.
            if time.monotonic() >= self.deadline:
                raise LeaseLost(f"renew answered {status} until the lease ran out")
            self.next_renew = time.monotonic() + min(1.0, self.renew_every_s)
            log(f"renew answered {status} {body}; retrying")


def take_lease(store, args):
    """Acquire the twin's lease (waiting for it with --wait-for-lease)."""
    while True:
        sent_at = time.monotonic()
        status, body = store.acquire(args.twin, args.holder, args.ttl_ms)
        if status == 201:
            return body, sent_at
        if status == 409 and body and body.get("error") == "lease_held":
            msg = f"twin/{args.twin} is held by {body['holder']} for {body['expires_in_ms']} ms"
            if not args.wait_for_lease:
                log(f"{msg}; exiting (--wait-for-lease waits for it)")
                sys.exit(EXIT_HELD)
            log(f"{msg}; waiting")
            time.sleep(min(body["expires_in_ms"], 1000) / 1000 + 0.05)
            continue
        raise RuntimeError(f"POST /v1/leases: {status} {body}")


def load_event_pb2(proto_dir):
    """The module grpc_tools.protoc generates from proto/palisade/v1/event.proto."""
    sys.path.insert(0, str(proto_dir))
    try:
        from palisade.v1 import event_pb2  # noqa: PLC0415 (only the protobuf format needs it)
    except ImportError as e:
        sys.exit(
            f"cannot import palisade.v1.event_pb2 from {proto_dir} ({e}). Generate it:\n"
            f"  python -m grpc_tools.protoc -I proto --python_out={proto_dir} "
            "proto/palisade/v1/event.proto   (from the repository root)"
        )
    return event_pb2


def encoder(fmt, proto_dir):
    """(content-type, function event -> record value) for the record format."""
    if fmt == "json":
        # Exactly the HTTP append body: one event object.
        return "application/json", lambda ev: json.dumps(ev).encode()
    event_pb2 = load_event_pb2(proto_dir)

    def encode(ev):
        return event_pb2.TwinEvent(
            event_id=ev["event_id"], type=ev["type"], patch_json=json.dumps(ev["patch"])
        ).SerializeToString()

    return "application/x-protobuf", encode


def applied_cursor(store, twin):
    """The twin's partition's head now: the store appends this worker's events after it."""
    status, body = store.twin(twin)
    if status == 404:
        return 0  # No event yet: the whole history will be ours and later writers'.
    if status != 200:
        raise RuntimeError(f"GET /v1/twins/{twin}: {status} {body}")
    return store.partition_head(body["partition"])


def wait_applied(store, twin, after, event_ids, timeout_s):
    """Wait until every id in event_ids is in the twin's history (Kafka ingestion is asynchronous)."""
    missing = set(event_ids)
    deadline = time.monotonic() + timeout_s
    while missing:
        status, body = store.twin_events(twin, after)
        if status != 200:
            raise RuntimeError(f"GET events of {twin}: {status} {body}")
        for ev in body["events"]:
            missing.discard(ev["event_id"])
        if body["events"]:
            after = body["next_after"]
        elif missing:
            if time.monotonic() >= deadline:
                return missing
            time.sleep(0.1)
    return missing


def parse_settings(pairs):
    out = {}
    for kv in pairs:
        k, sep, v = kv.partition("=")
        if not sep or not k:
            raise argparse.ArgumentTypeError(f"-X wants KEY=VALUE, got {kv!r}")
        out[k] = v
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--url", default="http://127.0.0.1:7070", help="the store's HTTP address")
    ap.add_argument("--brokers", required=True, help="Kafka bootstrap servers, HOST:PORT[,...]")
    ap.add_argument("--topic", default="twin-events", help="the topic the store ingests")
    ap.add_argument("--twin", required=True, help="the twin this worker writes")
    ap.add_argument("--holder", default="py-worker", help="lease holder name")
    ap.add_argument("--ttl-ms", type=int, default=10_000, help="lease TTL")
    ap.add_argument("--renew-every-ms", type=int, help="default: a third of the TTL")
    ap.add_argument("--format", choices=["json", "protobuf"], default="json", help="record value format")
    ap.add_argument(
        "--proto-dir",
        type=Path,
        default=Path(__file__).resolve().parent,
        help="where `palisade/v1/event_pb2.py` was generated (default: this folder)",
    )
    ap.add_argument("--count", type=int, default=10, help="events to publish (0: until stopped)")
    ap.add_argument("--interval-ms", type=int, default=1000, help="pause between events")
    ap.add_argument("--wait-for-lease", action="store_true", help="wait while another holder has it")
    ap.add_argument(
        "--apply-timeout-s", type=float, default=60, help="how long to wait for the store to apply the events"
    )
    ap.add_argument(
        "-X",
        dest="settings",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a librdkafka producer setting (repeatable), e.g. -X linger.ms=1",
    )
    args = ap.parse_args(argv)
    if args.count < 0 or args.interval_ms < 0:
        ap.error("--count and --interval-ms must not be negative")
    if args.ttl_ms < 100:
        ap.error("--ttl-ms must be at least 100 (the store's minimum)")
    renew_every_ms = args.renew_every_ms or args.ttl_ms // 3
    if not 0 < renew_every_ms < args.ttl_ms:
        ap.error("--renew-every-ms must be above 0 and below --ttl-ms")
    try:
        settings = parse_settings(args.settings)
    except argparse.ArgumentTypeError as e:
        ap.error(str(e))

    from confluent_kafka import KafkaError, KafkaException, Producer  # noqa: PLC0415 (--help works without it)

    content_type, encode = encoder(args.format, args.proto_dir)
    store = Store(args.url)

    stop = {"signal": None}

    def on_signal(signum, _frame):
        stop["signal"] = signal.Signals(signum).name

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)

    conf = {
        "bootstrap.servers": args.brokers,
        # Durable before acknowledged, and no duplicates from the producer's
        # own retries (a retry the store sees twice is deduplicated by event id anyway).
        "acks": "all",
        "enable.idempotence": True,
        # librdkafka's default partitioner is fine: the store routes each
        # record by its key (docs/decisions/0018-ingest-any-partition.md).
    }
    conf.update(settings)
    try:
        # Before the lease, so that a bad setting leaves no lease behind.
        producer = Producer(conf)
    except KafkaException as e:
        ap.error(f"the producer refused its settings: {e}")

    # Before the lease: our events go after what the partition holds now.
    after = applied_cursor(store, args.twin)
    grant, sent_at = take_lease(store, args)
    lease = Lease(store, grant, renew_every_ms / 1000, sent_at)
    log(
        f"lease acquired lease_id={lease.lease_id} token={lease.token} scope=twin/{args.twin} ttl_ms={grant['ttl_ms']}"
    )

    delivered, unsent, failed = [], [], []

    def on_delivery(event_id, err, msg):
        if err is None:
            delivered.append(event_id)
            log(f"delivered event_id={event_id} partition={msg.partition()} offset={msg.offset()}")
        elif err.code() in (KafkaError._PURGE_QUEUE, KafkaError._PURGE_INFLIGHT):
            unsent.append(event_id)
        else:
            failed.append((event_id, str(err)))
            log(f"delivery failed event_id={event_id}: {err}")

    headers = [("fencing-token", str(lease.token)), ("content-type", content_type)]
    lost = None
    i = 0
    try:
        while (args.count == 0 or i < args.count) and not stop["signal"]:
            lease.renew_if_due(time.monotonic())
            # Unique per lease and stable for a retry: the token names the lease.
            ev = {
                "type": "telemetry",
                "patch": {"n": i, "by": args.holder, "format": args.format},
                "event_id": f"{args.holder}-{lease.token}-{i}",
            }
            eid = ev["event_id"]
            producer.produce(
                args.topic,
                key=args.twin.encode(),
                value=encode(ev),
                headers=headers,
                on_delivery=lambda err, msg, eid=eid: on_delivery(eid, err, msg),
            )
            producer.poll(0)
            i += 1
            if args.interval_ms:
                time.sleep(args.interval_ms / 1000)
    except LeaseLost as e:
        lost = str(e)

    if lost is not None:
        # What is still queued would only reach the store to be dropped (if
        # the twin was granted again) or, worse, applied after we gave up:
        # drop it here. A record already in flight may still land; the store
        # fences it by its token.
        log(f"lease lost reason={lost}: stopping")
        producer.purge(in_queue=True, in_flight=False)
        producer.flush(30)
        log(f"stopped: lease lost; delivered={len(delivered)} unsent={len(unsent)} failed={len(failed)}")
        status, body = store.twin(args.twin)
        log(f"state {json.dumps(body.get('state') if status == 200 else None, sort_keys=True)}")
        return EXIT_LOST

    left = producer.flush(60)
    if left or failed:
        log(f"error: {left} records not delivered, {len(failed)} failed")
        return EXIT_ERROR
    missing = wait_applied(store, args.twin, after, delivered, args.apply_timeout_s)
    if missing:
        log(f"error: {len(missing)} of {len(delivered)} events not applied after {args.apply_timeout_s} s")
        return EXIT_ERROR
    log(f"applied {len(delivered)} events" + (f" (stopped by {stop['signal']})" if stop["signal"] else ""))
    status, body = store.twin(args.twin)
    if status != 200:
        log(f"error: GET /v1/twins/{args.twin}: {status} {body}")
        return EXIT_ERROR
    log(f"state {json.dumps(body['state'], sort_keys=True)}")
    # Only now: released earlier, a new holder's grant could fence records
    # of ours still waiting in the topic.
    status, body = store.release(lease.lease_id)
    if status == 204:
        log(f"released lease_id={lease.lease_id}")
    else:
        log(f"release answered {status} {body}")
    return EXIT_OK


if __name__ == "__main__":
    try:
        sys.exit(main())
    except (OSError, RuntimeError) as e:
        # The store unreachable or answering what a worker cannot go on
        # from: one line, not a traceback.
        log(f"error: {e}")
        sys.exit(EXIT_ERROR)
