# Sourced by every results/<claim>/run.sh from the repository root: where the data sets are and
# where the runs' working folders go (override any of them in the environment).
MNIST=${MNIST:-../shared/data/mnist}
FMNIST=${FMNIST:-/usr/share/datasets/fashion-mnist}  # apt-get install dataset-fashion-mnist
CIFAR=${CIFAR:-../shared/data/cifar10/cifar10_jpg.tar.gz}
WORK=${WORK:-/tmp/safe_optax_evidence}
# A run's output into its claim folder, under the name benchmarks/report.py reads.
keep() { cp "$1" "$2"; }
