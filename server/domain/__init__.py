"""Domain layer: session configs, the coordinator, placement, staleness, clocks and votes, and the
shard's session (staging, idempotency, ticket order, sync averaging, rejections).

Imports neither ``grpc`` nor ``ray``: transports and actors are injected by the process hosts.
"""
