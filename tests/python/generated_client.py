"""Drive a store with the client openapi-python-client generated from its
/v1/openapi.json: every module imports, then acquire, append, read, and a
stale token refused with 409 stale_token, each answer parsed into the model
the document names. Run by 02_generated_client.rs:

    PYTHONPATH=<folder holding the generated package> python generated_client.py BASE_URL PACKAGE TWIN

Prints one `ok ...` line per step and exits 0; any mismatch raises.
"""

import importlib
import pkgutil
import sys

base, package, twin = sys.argv[1], sys.argv[2], sys.argv[3]

pkg = importlib.import_module(package)
# A document that generates code which does not import (a bad name, a
# dangling reference) fails here, even in operations this script never calls.
modules = [m.name for m in pkgutil.walk_packages(pkg.__path__, package + ".")]
for name in modules:
    importlib.import_module(name)
print(f"ok imported {len(modules)} modules")

models = importlib.import_module(package + ".models")
acquire = importlib.import_module(package + ".api.leases.acquire")
release = importlib.import_module(package + ".api.leases.release")
append = importlib.import_module(package + ".api.events.append")
get_twin = importlib.import_module(package + ".api.events.get_twin")
client_mod = importlib.import_module(package + ".client")

client = client_mod.Client(base_url=base, raise_on_unexpected_status=True)


def expect(value, cls, what):
    assert isinstance(value, cls), f"{what}: expected {cls.__name__}, got {type(value).__name__}: {value!r}"
    return value


def lease(holder):
    return acquire.sync(
        client=client, body=models.LeaseIn(scope=f"twin/{twin}", holder=holder, ttl_ms=60_000)
    )


# 1. Acquire.
a = expect(lease("gen-a"), models.LeaseOut, "acquire by gen-a")
assert a.scope == f"twin/{twin}" and a.holder == "gen-a", a
print(f"ok acquired token={a.token}")

# 2. Append under it.
patch = models.EventInPatch.from_dict({"rpm": 1200, "door": {"open": False}})
r = append.sync(
    twin,
    client=client,
    body=models.EventIn(type_="telemetry", patch=patch, event_id="gen-a-1"),
    fencing_token=a.token,
)
r = expect(r, models.AppendResponse, "append with the current token")
assert len(r.seqs) == 1 and r.duplicates == 0, r
print(f"ok appended seq={r.seqs[0]} partition={r.partition}")

# 3. Read the twin.
t = expect(get_twin.sync(twin, client=client), models.TwinResponse, "get_twin")
assert t.twin_id == twin, t
assert t.state.to_dict() == {"rpm": 1200, "door": {"open": False}}, t.state.to_dict()
print(f"ok read state={t.state.to_dict()}")

# 4. Another holder is refused while the lease is live ...
held = expect(lease("gen-b"), models.LeaseHeldError, "acquire by gen-b while gen-a holds it")
assert held.error == "lease_held" and held.holder == "gen-a", held
print("ok lease_held")

# ... and granted once it is released; the grant raises the fence.
assert release.sync_detailed(a.lease_id, client=client).status_code == 204
b = expect(lease("gen-b"), models.LeaseOut, "acquire by gen-b after release")
assert b.token > a.token, (a.token, b.token)
print(f"ok acquired token={b.token}")

# 5. The old token is stale: 409 stale_token, parsed into its model.
r = append.sync_detailed(
    twin,
    client=client,
    body=models.EventIn(
        type_="telemetry", patch=models.EventInPatch.from_dict({"rpm": 1}), event_id="gen-a-2"
    ),
    fencing_token=a.token,
)
assert r.status_code == 409, (r.status_code, r.content)
stale = expect(r.parsed, models.StaleTokenError, "append with the old token")
assert stale.error == "stale_token", stale
assert (stale.token, stale.fence) == (a.token, b.token), stale
print(f"ok stale_token token={stale.token} fence={stale.fence}")

# The new holder writes; the stale write left nothing behind.
r = append.sync(
    twin,
    client=client,
    body=[
        models.EventIn(
            type_="telemetry", patch=models.EventInPatch.from_dict({"rpm": 900}), event_id="gen-b-1"
        )
    ],
    fencing_token=b.token,
)
expect(r, models.AppendResponse, "append with the new token")
t = expect(get_twin.sync(twin, client=client), models.TwinResponse, "get_twin")
assert t.state.to_dict() == {"rpm": 900, "door": {"open": False}}, t.state.to_dict()
print(f"ok read state={t.state.to_dict()}")
