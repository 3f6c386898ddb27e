#!/bin/sh
# Robustness of the 90 %-sparse MNIST MLP (8k / 2k, 10 epochs, one seed) to corruptions and PGD.
set -eu
cd "$(dirname "$0")/../.."  # the repository root
. benchmarks/claims/env.sh
python benchmarks/claims/robustness_mnist.py --preset mlp-mnist --data-dir $MNIST --test-only-split 8000 2000 --epochs 10 --seeds 0 --corruption-subset 500 --workdir $WORK/rob_mnist --out results/robustness_mnist
python benchmarks/report.py
