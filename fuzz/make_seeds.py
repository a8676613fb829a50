#!/usr/bin/env python3
"""Write the hand-made seed inputs of each fuzz target into corpus/<target>/
(files named seed-*). Run from fuzz/: python3 make_seeds.py. The layouts are
described in README.md and src/lib.rs."""
import json
import os
import struct

HERE = os.path.dirname(os.path.abspath(__file__))


def write(target, name, data):
    d = os.path.join(HERE, "corpus", target)
    os.makedirs(d, exist_ok=True)
    if isinstance(data, str):
        data = data.encode()
    with open(os.path.join(d, "seed-" + name), "wb") as f:
        f.write(data)


# --- codec_event: [FORMAT_VERSION=1] ++ bincode(standard, varint) of Event
def s(b):  # a length-prefixed string (length < 251: one byte)
    return bytes([len(b)]) + b


golden = (bytes([1]) + bytes([251, 44, 1]) + s(b"d7") + s(b"e1") + s(b"t")
          + s(b'{"a":1}') + bytes([1]) + bytes([2] + [0] * 15) + s(b"w")
          + bytes([34]) + bytes([5]))
write("codec_event", "golden", golden)
write("codec_event", "empty", b"")
write("codec_event", "version-9", bytes([9, 1, 2]))
write("codec_event", "truncated", golden[:12])
write("codec_event", "trailing", golden + b"\0")
write("codec_event", "huge-length", bytes([1, 0, 0xFF] + [0xFF] * 7 + [0x7F]))
write("codec_event", "u64-max-seq", bytes([1, 253]) + b"\xff" * 8 + golden[4:])
write("codec_event", "bad-utf8", golden.replace(b"\x02d7", b"\x02\xff\xfe"))

# --- http_events_json: the body of POST /v1/twins/{id}/events
H = "http_events_json"
write(H, "one", '{"type":"t","patch":{"a":1}}')
write(H, "full", '{"type":"tick","patch":{"n":1,"by":"A","door":{"open":false}},'
      '"event_id":"A-1","hlc":"7714683500161006112/1"}')
write(H, "batch", '[{"type":"t","patch":{}},{"type":"u","patch":{"b":null},"event_id":"x"}]')
write(H, "empty-batch", "[]")
write(H, "bad-json", '{"type":"t","patch":')
write(H, "patch-not-object", '{"type":"t","patch":5}')
write(H, "bad-hlc", '{"type":"t","patch":{},"hlc":"1/0"}')
write(H, "extra-field", '{"type":"t","patch":{},"extra":1}')
write(H, "wrong-type", '{"type":5,"patch":{}}')
write(H, "non-utf8", b'{"type":"\xff\xfe","patch":{}}')
write(H, "deep", '{"type":"t","patch":' + '{"a":' * 40 + "1" + "}" * 40 + "}")
write(H, "big-numbers", '{"type":"t","patch":{"a":1e308,"b":-0.0,"c":18446744073709551616}}')
write(H, "unicode", '{"type":"\\u00e9\\ud83d\\ude00","patch":{"\\u0000":"x"},"event_id":"\\u2028"}')

# --- kafka_record: flags, partitions-1, partition, offset, max, key-len,
# key, value-len (u16 LE), value, then headers: name-len, name, has-value,
# value-len, value. Flags: 1 key, 2 value, 4 put it in its twin's partition,
# 8 decode without strict partitioning (records routed by key).
def record(flags, key, value, headers, partitions=16, partition=0, max_byte=0):
    out = bytes([flags, partitions - 1, partition & 0xFF, 1, max_byte])
    out += bytes([len(key)]) + key + struct.pack("<H", len(value)) + value
    for name, val in headers:
        out += bytes([len(name)]) + name
        if val is None:
            out += bytes([0, 0])
        else:
            out += bytes([1, len(val)]) + val
    return out


def pb_str(field, b):  # a protobuf length-delimited field
    return bytes([(field << 3) | 2, len(b)]) + b


proto = pb_str(1, b"e1") + pb_str(2, b"t") + pb_str(3, b'{"a":1}')
proto_hlc = proto + pb_str(4, b"7714683500161006112/1")
jvalue = json.dumps({"type": "t", "patch": {"a": 1}, "event_id": "k-1"}).encode()
tok = (b"fencing-token", b"12")
ctj = (b"content-type", b"application/json")
K = "kafka_record"
write(K, "proto", record(7, b"pump-7", proto, [tok]))
write(K, "proto-hlc", record(7, b"pump-7", proto_hlc, [tok, (b"hlc", b"7714683500161006112/2")]))
write(K, "json", record(7, b"pump-7", jvalue, [tok, ctj]))
write(K, "json-batch", record(7, b"pump-7", b"[" + jvalue + b"," + jvalue + b"]", [tok, ctj]))
write(K, "no-key", record(6, b"", proto, [tok]))
write(K, "no-value", record(5, b"pump-7", b"", [tok]))
write(K, "wrong-partition", record(3, b"pump-7", proto, [tok], partition=200))
write(K, "no-token", record(7, b"pump-7", proto, []))
write(K, "null-token", record(7, b"pump-7", proto, [(b"fencing-token", None)]))
write(K, "negative-token", record(7, b"pump-7", proto, [(b"fencing-token", b"-1")]))
write(K, "overflow-token", record(7, b"pump-7", proto, [(b"fencing-token", b"18446744073709551616")]))
write(K, "two-tokens", record(7, b"pump-7", proto, [(b"fencing-token", b"x"), tok]))
write(K, "bad-hlc", record(7, b"pump-7", proto, [tok, (b"hlc", b"nope")]))
write(K, "bad-content-type", record(7, b"pump-7", proto, [tok, (b"content-type", b"text/plain")]))
write(K, "too-large", record(7, b"pump-7", proto, [tok], max_byte=1))
write(K, "bad-proto", record(7, b"pump-7", b"\xff\xff\xff", [tok]))
write(K, "bad-patch", record(7, b"pump-7", pb_str(3, b"[1]"), [tok]))
write(K, "bad-key-utf8", record(7, b"\xff\xfe", proto, [tok]))
write(K, "one-partition", record(7, b"k", proto, [tok], partitions=1))
write(K, "any-partition", record(11, b"pump-7", proto, [tok], partition=200))
write(K, "two-same-tokens", record(7, b"pump-7", proto, [tok, tok]))
