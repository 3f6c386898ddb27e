#!/bin/sh
# §4.1 on MNIST (8k / 2k): lambdas chosen on a 2k validation split, then 5 seeds of 100 epochs.
set -eu
cd "$(dirname "$0")/../.."  # the repository root
. benchmarks/claims/env.sh
python benchmarks/claims/flatness_mlp.py --dataset mnist --epochs 100 --seeds 5 --select --out results/flatness_mnist --no-progress
python benchmarks/report.py
