"""What operators see and what keeps a server tidy: Prometheus metrics (:mod:`.metrics`, every
name and help text declared once in ``METRICS``), structured logs (:mod:`.logs`), gRPC health
checking and reflection (:mod:`.health`), idle-session leases (:mod:`.leases`) and the watch that
replaces dead shard actors (:mod:`.shard_watch`), both on :class:`.periodic.Periodic` threads.

Imported by the process hosts (``app.py``, ``shard_actor.py``, ``cli.py``); it may use the layers
below (wire, domain, storage, compute), never the other way round.
"""
