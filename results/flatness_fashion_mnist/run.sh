#!/bin/sh
# §4.1 on Fashion-MNIST (60k / 10k): lambdas chosen on a 10k validation split, 3 seeds of 20 epochs.
set -eu
cd "$(dirname "$0")/../.."  # the repository root
. benchmarks/claims/env.sh
python benchmarks/claims/flatness_mlp.py --dataset fashion_mnist --epochs 20 --seeds 3 --select --select-seeds 1 --validation 10000 --safe-grid 0.001 0.01 0.1 --admm-grid 0.001 0.01 0.1 --out results/flatness_fashion_mnist --no-progress
python benchmarks/report.py
