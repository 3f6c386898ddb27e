#!/bin/sh
# §4.1 on Fashion-MNIST (60k / 10k): lambdas chosen on a 10k validation split, 3 seeds of 20 epochs;
# then the same lambdas and seeds at 40 epochs, the longer budget of the convergence check.
set -eu
cd "$(dirname "$0")/../.."  # the repository root
. benchmarks/claims/env.sh
# ADMM's λ first chose 0.001, its grid's lower end ({0.001, 0.01, 0.1}): the edge rule adds 0.0001
# (declared 2026-11-27, before this run).
python -m benchmarks.claims.flatness_mlp --dataset fashion_mnist --epochs 20 --seeds 3 --select --select-seeds 1 --validation 10000 --safe-grid 0.001 0.01 0.1 --admm-grid 0.0001 0.001 0.01 0.1 --out results/flatness_fashion_mnist --no-progress
O=results/flatness_fashion_mnist
set -- $(python -c "import json, sys; c = json.load(open(sys.argv[1]))['selection']['chosen']; print(c['safe'], c['admm'])" $O/flatness_fashion_mnist.json)
python -m benchmarks.claims.flatness_mlp --dataset fashion_mnist --epochs 40 --seeds 3 --safe-penalty $1 --admm-penalty $2 --out $WORK/flatness_fashion_mnist_40 --no-progress
keep $WORK/flatness_fashion_mnist_40/flatness_fashion_mnist.json $O/flatness_fashion_mnist_40epochs.json
python -m benchmarks.report
