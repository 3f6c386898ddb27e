"""Benchmarks and claim reproductions; run each as a module from the repository root.

  python -m benchmarks.claims.sparsity_sweep --help   # a claim's runs (results/<claim>/run.sh)
  python -m benchmarks.perf.step_overhead --help      # a performance measurement
  python -m benchmarks.report --check                 # the evidence report from results/
"""
