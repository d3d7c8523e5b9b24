"""Compute layer: the updater (buffers, jit, donated update, partial statistics), where matrix
roots are computed (root offload), and the preconditioner pool and workers. Calls the kernels;
imports nothing from the wire or domain layers."""
