"""Each ``Client`` dials connections of its own: the Clients of one process (a crowd of worker
threads) do not take turns on one shared TCP connection to the server."""

from __future__ import annotations

import psutil

from optserve.client import Client


def _established_to(port: int) -> set:
    """This process's open connections to ``port`` (their local addresses)."""
    return {c.laddr for c in psutil.Process().net_connections(kind="tcp")
            if c.raddr and c.raddr.port == port and c.status == psutil.CONN_ESTABLISHED}


def test_three_clients_of_one_process_hold_three_connections_to_the_server(server):
    port = int(server.address.rsplit(":", 1)[1])
    before = _established_to(port)
    clients = [Client(server.address, timeout=30.0) for _ in range(3)]
    try:
        for client in clients:
            client.list_sessions()
        # one shared pool gives 0 or 1 new connections (others' may open or close meanwhile)
        assert len(_established_to(port) - before) >= 3
    finally:
        for client in clients:
            client.close()
