"""Compute layer: the updater (buffers, jit, donated update, partial statistics), where matrix
roots are computed (root offload), the preconditioner pool and workers, and the shard process's
malloc settings (``heap.py``: parameter-sized buffers kept on the heap). Calls the kernels;
imports nothing from the wire or domain layers."""
