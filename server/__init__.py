"""The optserve server: a coordinator (control plane) and shard actors (data plane) on Ray.

Layers, imports pointing down only (``tests/test_layers.py`` enforces it):

wire/     control_servicer.py (Control), shard_servicer.py (ShardData; its PushPull stream in
          push_pull.py with push_framings.py, open_streams.py, data_requests.py, data_replies.py),
          clock_service.py (the session clock between shards: PeerClock), convert.py (proto <->
          domain records), errors.py (the one table of domain errors -> gRPC status codes)
domain/   config.py (typed, validated configuration); the coordinator: coordinator.py over
          session_table.py (one entry per session, its state and transitions), session_records.py,
          session_restore.py; placement.py, staleness.py; the session clock, the session-wide
          ordering authority: clock.py (the Clock protocol, HomeClock) over clock_state.py,
          votes.py, cross_shard_sums.py, rounds.py (elastic rounds); one session on one shard:
          shard_session.py (the facade: initial values, receive, read, status), staging.py,
          step_runner.py (decided tickets applied in order), apply_queue.py (the shard's apply
          queue), step_journal.py (the durable step: log space, log order, checkpoints, restore;
          log_recovery.py recovers an unlogged step) with durability.py (policy, records, the StepLogPort / CheckpointPort storage
          implements) and replay.py; assembly.py (chunks -> validated buffers), host_passes.py
          (large host copies and finite checks split over threads), errors.py
storage/  the versioned on-disk format: the step log and ticket journal, checkpoints, the catalog
compute/  updater.py (parameters, optimizer state, one jitted donated step), buffers.py,
          host_transfer.py (device arrays to host through pinned memory),
          root_offload.py (where matrix roots are computed), preconditioner_pool.py and
          preconditioner_worker.py (the workers that compute them), heap.py
ops/      what operators see: metrics, logs, health, leases, the shard watch

On top, the process hosts that wire the layers together: app.py (``start_server(config)``),
cli.py (``optserve serve``), shard_actor.py (the Ray actor), shard_fleet.py (the coordinator's
handle on the actors), preflight.py. docs/ARCHITECTURE.md walks one step through them.
"""
