#!/bin/sh
# Robustness of the 90 %-sparse MNIST MLP (8k / 2k) to corruptions and PGD. λ for SAFE and ADMM is
# chosen on 2,000 held-out training images (seed 0) from the grids declared in
# benchmarks/claims/tuning.py before these runs (2026-11-27); 20 epochs, three test seeds.
set -eu
cd "$(dirname "$0")/../.."  # the repository root
. benchmarks/claims/env.sh
python benchmarks/claims/robustness_mnist.py --preset mlp-mnist --data-dir $MNIST --test-only-split 8000 2000 --epochs 20 --seeds 0 1 2 --validation 2000 --safe-grid 0.01 0.1 1 10 --admm-grid 0.001 0.01 0.1 1 --rescale-dual --corruption-subset 500 --workdir $WORK/rob_mnist --out results/robustness_mnist
python benchmarks/report.py
