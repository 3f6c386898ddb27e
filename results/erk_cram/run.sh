#!/bin/sh
# SAFE, CrAM and GMP with RigL's ERK allocation at 99 / 99.5 % (Fashion-MNIST MLP); lambda and
# CrAM's rho chosen on a 10k validation split at each budget.
set -eu
cd "$(dirname "$0")/../.."  # the repository root
. benchmarks/claims/env.sh
O=results/erk_cram
E="python -m benchmarks.claims.sparsity_sweep --preset mlp-fashion-mnist --data-dir $FMNIST --methods cram gmp safe --sparsities 0.99 0.995 --seeds 0 1 2 --warmup-epochs 2 --rescale-dual --structure erk --safe-grid 0.001 0.003 0.01 0.03"
$E --epochs 20 --eval-every 5 --workdir $WORK/fmnist_mlp --cram-grid 0 0.001 0.003 0.01 0.03 0.1 --out $WORK/erk20
keep $WORK/erk20/sweep.json $O/sweep_20epochs.json
$E --epochs 40 --eval-every 10 --workdir $WORK/fmnist_mlp40 --cram-grid 0 0.003 0.01 --out $WORK/erk40
keep $WORK/erk40/sweep.json $O/sweep_40epochs.json
# CrAM's ρ grid at 40 epochs had three values, SAFE's λ grid four: ρ 0.001 is added (declared
# 2026-11-27, before its runs), scored on the same validation split; where it wins, three test
# seeds follow at 40 epochs.
$E --epochs 40 --eval-every 10 --workdir $WORK/fmnist_mlp40 --methods cram --cram-grid 0 0.001 0.003 0.01 --reuse-selection $O/sweep_40epochs.json --select-only --out $WORK/erk40_cram
keep $WORK/erk40_cram/sweep.json $O/selection_40epochs_cram.json
# 0.001 won at 99.5 % (0.003 stays at 99 %): CrAM's three test seeds there at 0.001.
$E --epochs 40 --eval-every 10 --workdir $WORK/fmnist_mlp40 --methods cram --sparsities 0.995 --cram-grid 0 0.001 0.003 0.01 --reuse-selection $O/selection_40epochs_cram.json --out $WORK/erk40_cram_s995
keep $WORK/erk40_cram_s995/sweep.json $O/sweep_40epochs_cram_s995.json
# GMP's schedule end chosen on the same validation split at 40 epochs, from four values as SAFE's
# lambda (grid declared in benchmarks/claims/tuning.py before these runs).
python -m benchmarks.claims.gmp_selection --sweep $O/sweep_40epochs.json --end-grid 0.25 0.5 0.75 0.9 --data-dir $FMNIST --workdir $WORK/erk_gmp --out $O/gmp_selection_40epochs.json
# The convergence rule's shorter budget: 20 epochs with the 40-epoch picks and the same seeds
# (SAFE's lambda and CrAM's rho as one-value grids: given, not selected; GMP's end read from the
# 40-epoch selection with --chosen-from, not chosen again).
T="python -m benchmarks.claims.sparsity_sweep --preset mlp-fashion-mnist --data-dir $FMNIST --methods safe cram --seeds 0 1 2 --epochs 20 --warmup-epochs 2 --eval-every 5 --workdir $WORK/fmnist_mlp --rescale-dual --structure erk"
$T --sparsities 0.99 --safe-grid 0.003 --cram-grid 0.003 --out $WORK/erk20_s99
keep $WORK/erk20_s99/sweep.json $O/sweep_20epochs_chosen40_s99.json
$T --sparsities 0.995 --safe-grid 0.01 --cram-grid 0.001 --out $WORK/erk20_s995
keep $WORK/erk20_s995/sweep.json $O/sweep_20epochs_chosen40_s995.json
for s in s99 s995; do
  python -m benchmarks.claims.gmp_selection --sweep $O/sweep_40epochs.json --test-sweep $O/sweep_20epochs_chosen40_$s.json --chosen-from $O/gmp_selection_40epochs.json --data-dir $FMNIST --workdir $WORK/erk_gmp --out $O/gmp_20epochs_$s.json
done
python -m benchmarks.report
