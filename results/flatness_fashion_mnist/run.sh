#!/bin/sh
# §4.1 on Fashion-MNIST (60k / 10k): lambdas chosen on a 10k validation split, 3 seeds of 20 epochs.
set -eu
cd "$(dirname "$0")/../.."  # the repository root
. benchmarks/claims/env.sh
# ADMM's λ first chose 0.001, its grid's lower end ({0.001, 0.01, 0.1}): the edge rule adds 0.0001
# (declared 2026-11-27, before this run).
python benchmarks/claims/flatness_mlp.py --dataset fashion_mnist --epochs 20 --seeds 3 --select --select-seeds 1 --validation 10000 --safe-grid 0.001 0.01 0.1 --admm-grid 0.0001 0.001 0.01 0.1 --out results/flatness_fashion_mnist --no-progress
python benchmarks/report.py
