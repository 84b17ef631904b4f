"""Benchmark drivers, peers, profilers and plots: they measure the engine and are not part
of it. Run them from the repository root, e.g. ``python -m benchmarks.offline --help``."""
