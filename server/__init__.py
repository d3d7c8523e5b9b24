"""The optserve server: a coordinator (control plane) and shard actors (data plane) on Ray.

Three layers, imports pointing down only (``tests/test_layers.py`` enforces it):

wire/     control_servicer.py (Control), shard_servicer.py (ShardData), clock_service.py (the
          session clock between shards), convert.py (proto <-> domain records), errors.py (the
          one table of domain errors -> gRPC status codes)
domain/   config.py (typed, validated configuration), coordinator.py (sessions, shard map),
          placement.py, staleness.py, clock.py (versions, tickets, votes, cross-shard sums),
          shard_session.py (one session on one shard: staging, idempotency, ticket order, sync
          averaging, rejections), assembly.py (chunks -> validated buffers), errors.py
compute/  updater.py (parameters, optimizer state, one jitted donated step), buffers.py,
          root_offload.py (where matrix roots are computed), preconditioner_pool.py and
          preconditioner_worker.py (the workers that compute them)

On top, the process hosts that wire the three together: app.py (``start_server(config)``),
cli.py (``optserve serve``), shard_actor.py (the Ray actor and the coordinator's handle on it).
docs/ARCHITECTURE.md walks one step through them.
"""
