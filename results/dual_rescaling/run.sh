#!/bin/sh
# The paper's dual update against the rescaled one at 99.5 % under the cosine penalty ramp:
# 4,000 images with lambda fixed (a mechanism check), and the full data with lambda chosen.
set -eu
cd "$(dirname "$0")/../.."  # the repository root
. benchmarks/claims/env.sh
O=results/dual_rescaling
python benchmarks/claims/dual_rescaling.py --preset mlp-fashion-mnist --data-dir $FMNIST --sparsity 0.995 --penalties 0.1 1 --epochs 20 --warmup-epochs 2 --train-subset 4000 --test-subset 2000 --seeds 0 1 2 3 4 --workdir $WORK/dualresc --out $WORK/dualresc_out
keep $WORK/dualresc_out/dual_rescaling.json $O/dual_rescaling.json
keep $WORK/dualresc_out/dual_rescaling.png $O/dual_rescaling.png
F="python benchmarks/claims/sparsity_sweep.py --preset mlp-fashion-mnist --data-dir $FMNIST --sparsities 0.9 0.95 0.98 0.99 0.995 --seeds 0 1 2 --epochs 20 --warmup-epochs 2 --eval-every 5 --workdir $WORK/fmnist_mlp"
$F --methods dense safe admm gmp magnitude --out $WORK/mlp20_paper
keep $WORK/mlp20_paper/sweep.json $O/sweep_60k_20epochs_paper.json
$F --methods dense safe admm gmp magnitude imp-sam cram --rescale-dual --safe-grid 0.001 0.003 0.01 0.1 1 --admm-grid 0.0001 0.001 0.01 0.1 --out $WORK/mlp20_rescaled
keep $WORK/mlp20_rescaled/sweep.json $O/sweep_60k_20epochs_rescaled.json
python benchmarks/report.py
