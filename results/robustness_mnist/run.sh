#!/bin/sh
# MLP on MNIST (8k / 2k): lambdas chosen on a 2k validation split at 20 epochs with 3 test seeds;
# then the same lambdas and seeds at 40 and 80 epochs (--chosen-from), the budgets of the
# convergence check.
set -eu
cd "$(dirname "$0")/../.."  # the repository root
. benchmarks/claims/env.sh
O=results/robustness_mnist
R="python -m benchmarks.claims.robustness_mnist --preset mlp-mnist --data-dir $MNIST --test-only-split 8000 2000 --seeds 0 1 2 --rescale-dual --corruption-subset 500"
$R --epochs 20 --validation 2000 --safe-grid 0.01 0.1 1 10 --admm-grid 0.001 0.01 0.1 1 --workdir $WORK/rob_mnist --out $O
for E in 40 80; do
  $R --epochs $E --chosen-from $O/robustness_mlp-mnist.json --workdir $WORK/rob_mnist_$E --out $WORK/rob_mnist_${E}_out
  keep $WORK/rob_mnist_${E}_out/robustness_mlp-mnist.json $O/robustness_mlp-mnist_${E}epochs.json
  keep $WORK/rob_mnist_${E}_out/robustness_mlp-mnist.md $O/robustness_mlp-mnist_${E}epochs.md
done
python -m benchmarks.report
