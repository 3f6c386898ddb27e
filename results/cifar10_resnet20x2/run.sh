#!/bin/sh
# Table 5, ResNet-20x2 on CIFAR-10 at 90 %, on one GPU (two 15-minute leases of an H200 gave
# 39 epochs, seeds 0 and 1); CIFAR-10 as the JPEG archive cifar10_jpg.tar.gz.
set -eu
cd "$(dirname "$0")/../.."  # the repository root
. benchmarks/claims/env.sh
python -m benchmarks.claims.cifar_gpu --data-dir $CIFAR --out $WORK/cifar_lease1 --workdir $WORK/cifar_gpu --epochs 39 --seeds 0 --deadline-s 500
python -m benchmarks.claims.cifar_gpu --data-dir $CIFAR --out $WORK/cifar_lease2 --workdir $WORK/cifar_gpu --epochs 39 --seeds 1 --methods dense safe admm gmp --deadline-s 415
python -m benchmarks.claims.cifar_gpu --report-from $WORK/cifar_lease1 $WORK/cifar_lease2 --out results/cifar10_resnet20x2
python -m benchmarks.report
