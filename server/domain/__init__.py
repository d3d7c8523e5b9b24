"""Domain layer: what a session is and how it runs, in three subsystems and their shared vocabulary.

- ``clock/``: the session clock on the home shard: tickets, rounds, cross-shard sums, history,
  hyperparameter changes;
- ``shard/``: a session on one shard: pushes staged, tickets applied, steps made durable, reads;
- ``sessions/``: the coordinator's sessions: admission, placement, opening, status, restore;
- the vocabulary they share, here: ``config`` (sessions' and the server's options), ``errors``,
  ``events`` (log lines), ``telemetry`` (a session's series), ``durability`` (policy, step
  records, and the ports storage implements).

A subsystem imports another only through that package's exports (its ``__init__``). Imports
neither ``grpc`` nor ``ray``: transports and actors are injected by the process hosts.
"""
