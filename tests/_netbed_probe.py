"""Run on a host of the test bed (tests/test_netbed.py): what a client there sees of a session.

    python tests/_netbed_probe.py ADDRESS SESSION

Prints one JSON line: ``shards``, each ``{"index", "address", "node_id", "shared_memory"}``, where
``shared_memory`` says whether this client's bytes to that shard go through shared memory (the
SDK's same-host proof succeeded: the shard shares this host's ``/dev/shm``).
"""

from __future__ import annotations

import json
import sys

from optserve.client import Client


def main(address: str, name: str) -> None:
    with Client(address, timeout=30) as client:  # shared memory where proven (the default)
        session = client.session(name, worker_id="netbed-probe")
        paths = session._paths  # the data paths: which shard's bytes go where
        regions = paths.regions.ensure(paths.fanout.shards)
        shards = [{"index": s.index, "address": s.address, "node_id": s.node_id,
                   "shared_memory": regions.get(s.index) is not None} for s in session.status().shards]
        print(json.dumps({"shards": shards}), flush=True)
        session.detach()


if __name__ == "__main__":
    main(*sys.argv[1:3])
