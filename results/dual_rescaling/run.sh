#!/bin/sh
# The paper's dual update against the rescaled one at 99.5 % under the cosine penalty ramp:
# 4,000 images with lambda fixed (a mechanism check), and the full data with lambda chosen.
set -eu
cd "$(dirname "$0")/../.."  # the repository root
. benchmarks/claims/env.sh
O=results/dual_rescaling
python -m benchmarks.claims.dual_rescaling --preset mlp-fashion-mnist --data-dir $FMNIST --sparsity 0.995 --penalties 0.1 1 --epochs 20 --warmup-epochs 2 --train-subset 4000 --test-subset 2000 --seeds 0 1 2 3 4 --workdir $WORK/dualresc --out $WORK/dualresc_out
keep $WORK/dualresc_out/dual_rescaling.json $O/dual_rescaling.json
keep $WORK/dualresc_out/dual_rescaling.png $O/dual_rescaling.png
F="python -m benchmarks.claims.sparsity_sweep --preset mlp-fashion-mnist --data-dir $FMNIST --sparsities 0.9 0.95 0.98 0.99 0.995 --seeds 0 1 2 --epochs 20 --warmup-epochs 2 --eval-every 5 --workdir $WORK/fmnist_mlp"
$F --methods dense safe admm gmp magnitude --out $WORK/mlp20_paper
keep $WORK/mlp20_paper/sweep.json $O/sweep_60k_20epochs_paper.json
$F --methods dense safe admm gmp magnitude imp-sam cram --rescale-dual --safe-grid 0.001 0.003 0.01 0.1 1 --admm-grid 0.0001 0.001 0.01 0.1 --out $WORK/mlp20_rescaled
keep $WORK/mlp20_rescaled/sweep.json $O/sweep_60k_20epochs_rescaled.json
# At 99.5 % the paper's dual chose λ 0.01, its grid's lower end, from three values against the
# rescaled dual's five: it gets the same five, {0.001, 0.003, 0.01, 0.1, 1} (declared 2026-11-27,
# before these runs), its new values scored on the same validation split, then three test seeds.
$F --methods safe --sparsities 0.995 --safe-grid 0.001 0.003 0.01 0.1 1 --reuse-selection $O/sweep_60k_20epochs_paper.json --out $WORK/mlp20_paper_s995
keep $WORK/mlp20_paper_s995/sweep.json $O/sweep_60k_20epochs_paper_s995.json
# It chose 0.001, the new grid's lower end: the edge rule adds 0.0003 (half-decade spacing there;
# declared before its run), and the test seeds follow the new pick.
$F --methods safe --sparsities 0.995 --safe-grid 0.0003 0.001 0.003 0.01 0.1 1 --reuse-selection $O/sweep_60k_20epochs_paper_s995.json --out $WORK/mlp20_paper_s995_ext
keep $WORK/mlp20_paper_s995_ext/sweep.json $O/sweep_60k_20epochs_paper_s995.json
python -m benchmarks.report
