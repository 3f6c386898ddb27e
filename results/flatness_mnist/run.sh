#!/bin/sh
# §4.1 on MNIST (8k / 2k): lambdas chosen on a 2k validation split, then 5 seeds of 100 epochs;
# then the same lambdas and seeds at 50 and 200 epochs, the budgets of the convergence check.
set -eu
cd "$(dirname "$0")/../.."  # the repository root
. benchmarks/claims/env.sh
O=results/flatness_mnist
python -m benchmarks.claims.flatness_mlp --dataset mnist --epochs 100 --seeds 5 --select --out $O --no-progress
# the lambdas the 100-epoch selection chose: SAFE's, then ADMM's
set -- $(python -c "import json, sys; c = json.load(open(sys.argv[1]))['selection']['chosen']; print(c['safe'], c['admm'])" $O/flatness_mnist.json)
for E in 50 200; do
  python -m benchmarks.claims.flatness_mlp --dataset mnist --epochs $E --seeds 5 --safe-penalty $1 --admm-penalty $2 --out $WORK/flatness_mnist_$E --no-progress
  keep $WORK/flatness_mnist_$E/flatness_mnist.json $O/flatness_mnist_${E}epochs.json
done
python -m benchmarks.report
