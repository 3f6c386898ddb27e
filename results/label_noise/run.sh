#!/bin/sh
# Table 3 on the MNIST MLP (8k / 2k, 90 %): lambda per noise ratio chosen on a noisy 2k validation
# split (3 seeds), 25 / 50 % rerun over 5 seeds with those lambdas, then rho chosen as well; every
# row then at 25 and 100 epochs with the same picks and seeds (the convergence rule's budgets).
set -eu
cd "$(dirname "$0")/../.."  # the repository root
. benchmarks/claims/env.sh
O=results/label_noise
N="python -m benchmarks.claims.label_noise --preset mlp-mnist --data-dir $MNIST --test-only-split 8000 2000 --sparsities 0.9 --epochs 50 --warmup-epochs 2 --batch-size 100 --workdir $WORK/label_noise"
S="--seeds 0 1 2 --validation 2000 --select-seeds 3 --admm-grid 0.0001 0.001 0.01 0.1 0.3 1"
$N --noise 0.25 0.5 0.75 $S --safe-grid 0.001 0.01 0.1 1 3 --out $WORK/ln_3seeds
keep $WORK/ln_3seeds/label_noise_mlp-mnist.json $O/label_noise_3seeds.json
$N --noise 0.25 0.5 --seeds 0 1 2 3 4 --safe-grid 3 --admm-grid 0.3 --out $WORK/ln_5seeds
keep $WORK/ln_5seeds/label_noise_mlp-mnist.json $O/label_noise_5seeds.json
$N --noise 0.75 $S --safe-grid 0.001 0.01 0.1 1 3 --rescale-dual --out $WORK/ln_rescaled
keep $WORK/ln_rescaled/label_noise_mlp-mnist_rescaled.json $O/label_noise_rescaled_rho0.1.json
$N --noise 0.25 0.5 $S --safe-grid 0.1 1 3 10 --rescale-dual --rho-grid 0.02 0.05 0.1 --out $WORK/ln_rho_2550
keep $WORK/ln_rho_2550/label_noise_mlp-mnist_rescaled_rhogrid.json $O/label_noise_25_50_rho_grid.json
# 75 % again with every grid declared in benchmarks/claims/tuning.py before any of these runs
# (half-decade grids of four lambdas for both methods, SAFE's rho below the paper's 0.1; one
# selection seed to fit the CPU budget); the edge rule there extends a grid whose pick is at an end.
$N --noise 0.75 --seeds 0 1 2 --validation 2000 --select-seeds 1 --safe-grid 0.3 1 3 10 --admm-grid 0.03 0.1 0.3 1 --rescale-dual --rho-grid 0.01 0.03 0.1 --out $WORK/ln_75_declared
keep $WORK/ln_75_declared/label_noise_mlp-mnist_rescaled_rhogrid.json $O/label_noise_75_declared.json
# The edge rule (EDGE_RULE in benchmarks/claims/tuning.py): SAFE's λ 3 sat at the upper end of
# its grid at every noise ratio, so 10 (the half-decade step) is scored on the same noisy
# validation split, the earlier runs reused; a changed pick is then run with the test seeds.
$N --noise 0.25 0.5 0.75 $S --safe-grid 0.001 0.01 0.1 1 3 10 --reuse-selection $O/label_noise_3seeds.json --out $WORK/ln_3seeds_edge
keep $WORK/ln_3seeds_edge/label_noise_mlp-mnist.json $O/label_noise_3seeds.json
$N --noise 0.75 $S --safe-grid 0.001 0.01 0.1 1 3 10 --rescale-dual --reuse-selection $O/label_noise_rescaled_rho0.1.json --out $WORK/ln_rescaled_edge
keep $WORK/ln_rescaled_edge/label_noise_mlp-mnist_rescaled.json $O/label_noise_rescaled_rho0.1.json
# SAFE's grid gets a sixth value, 0.3, as ADMM's has six (declared in benchmarks/claims/tuning.py
# on 2026-11-27, before these runs); a changed pick is then run with the test seeds.
$N --noise 0.25 0.5 0.75 $S --safe-grid 0.001 0.01 0.1 0.3 1 3 10 --reuse-selection $O/label_noise_3seeds.json --out $WORK/ln_3seeds_six
keep $WORK/ln_3seeds_six/label_noise_mlp-mnist.json $O/label_noise_3seeds.json
$N --noise 0.75 $S --safe-grid 0.001 0.01 0.1 0.3 1 3 10 --rescale-dual --reuse-selection $O/label_noise_rescaled_rho0.1.json --out $WORK/ln_rescaled_six
keep $WORK/ln_rescaled_six/label_noise_mlp-mnist_rescaled.json $O/label_noise_rescaled_rho0.1.json
# The convergence rule's budgets: every row's picks (lambda, and rho where chosen) and seeds again
# at 25 and at 100 epochs (--chosen-from reads them from the 50-epoch file that chose them); the
# 100-epoch rows lead, the 50-epoch rows are their budget checks (claim.json).
for E in 25 100; do
  C="$(echo "$N" | sed "s/--epochs 50/--epochs $E/")"
  $C --noise 0.25 0.5 0.75 --seeds 0 1 2 3 4 --chosen-from $O/label_noise_3seeds.json --out $WORK/ln_3seeds_$E
  keep $WORK/ln_3seeds_$E/label_noise_mlp-mnist.json $O/label_noise_${E}epochs.json
  $C --noise 0.25 0.5 --seeds 0 1 2 --rescale-dual --chosen-from $O/label_noise_25_50_rho_grid.json --out $WORK/ln_rho_2550_$E
  keep $WORK/ln_rho_2550_$E/label_noise_mlp-mnist_rescaled.json $O/label_noise_25_50_rho_grid_${E}epochs.json
  $C --noise 0.75 --seeds 0 1 2 --rescale-dual --chosen-from $O/label_noise_rescaled_rho0.1.json --out $WORK/ln_rescaled_$E
  keep $WORK/ln_rescaled_$E/label_noise_mlp-mnist_rescaled.json $O/label_noise_rescaled_rho0.1_${E}epochs.json
  $C --noise 0.75 --seeds 0 1 2 --rescale-dual --chosen-from $O/label_noise_75_declared.json --out $WORK/ln_75_declared_$E
  keep $WORK/ln_75_declared_$E/label_noise_mlp-mnist_rescaled.json $O/label_noise_75_declared_${E}epochs.json
done
python -m benchmarks.report
