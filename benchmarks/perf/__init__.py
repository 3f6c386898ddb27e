"""The performance measurements: each writes JSON under benchmarks/perf/results/."""
