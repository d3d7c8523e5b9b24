"""The optserve server: a coordinator (control plane) and shard actors (data plane) on Ray.

Layers, one job per module:

wire     control_servicer.py (Control), shard_servicer.py (ShardData), wire.py (proto <-> config),
         errors.py (domain exceptions -> gRPC status codes: the one mapping)
domain   config.py (typed, validated configuration), coordinator.py (sessions, shard map),
         placement.py (which shard holds which tensor), staleness.py (whether/how a push joins a
         step), clock.py (where a session's version lives; ticket order; cross-shard sums),
         clock_endpoint.py (how the other shards of a session reach its home shard's clock),
         assembly.py (chunks -> validated buffers)
compute  shard.py (the Ray actor serving ShardData), shard_state.py (a session's pytree on one
         shard: one jitted, donated update per step, Shampoo root offload
         around it), root_offload.py + preconditioner_pool.py + preconditioner_worker.py
startup  app.py (``start_server(config) -> RunningServer``), cli.py (``optserve serve``)

Staleness is decided by the session clock, where the version lives: the first shard to ask
for a push's ticket makes the decision, all shards then apply tickets in the same order.
"""
