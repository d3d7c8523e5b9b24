"""optserve benchmarks: each module times ours against a baseline in one run and prints medians and ratios."""
