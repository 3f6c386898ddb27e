"""The cost of the multi-process path: 1 process x 2 devices against 2 processes x 1 device.

Both layouts run the same ``safe-optax-vision train`` command (LeNet-5, SAFE
at 90 % sparsity, batch 128, on a random Fashion-MNIST-format data set written
to a temporary folder) over a 2-device mesh, so they compute the same global
batches and the same parameters; the 2-process run adds what the distributed
runtime costs: gloo collectives over loopback TCP instead of in-process ones,
a per-process host gather of its rows of every batch, two Python controllers.
The rate is ``steady_images_per_second`` of each run's ``results.json``
(training epochs after the first, which compiles). Layouts alternate, so
drifts of the machine's load hit both.

What this cannot measure: a real interconnect. Here the two "devices" are
the same two CPU cores and the collectives go through the kernel's loopback;
on a GPU node (NVLink, NCCL) or across hosts (InfiniBand, TPU ICI) the cost of
the all-reduces and its share of a step are different and must be measured
there.

  python -m benchmarks.perf.distributed_overhead [--repeats 3] [--epochs 3]
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import pathlib
import socket
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np

from benchmarks import harness

ROOT = pathlib.Path(__file__).resolve().parents[2]
N_TRAIN, N_TEST = 4096, 256


def write_data(directory: pathlib.Path, seed: int = 0) -> None:
  """Random 28x28 images (brightness grows with the label) as gzipped t10k idx files."""
  rng = np.random.default_rng(seed)
  n = N_TRAIN + N_TEST
  labels = rng.integers(0, 10, n).astype(np.uint8)
  images = np.clip(20 * labels[:, None, None] + rng.integers(0, 80, (n, 28, 28)), 0, 255)
  for name, array in (("t10k-images-idx3-ubyte", images.astype(np.uint8)),
                      ("t10k-labels-idx1-ubyte", labels)):
    header = (0x0800 | array.ndim).to_bytes(4, "big") + b"".join(
        d.to_bytes(4, "big") for d in array.shape)
    with gzip.open(directory / f"{name}.gz", "wb") as f:
      f.write(header + array.tobytes())


def command(data: pathlib.Path, workdir: pathlib.Path, epochs: int) -> list[str]:
  return [sys.executable, "-m", "safe_optax.vision.cli", "train",
          "--preset", "lenet5-fashion-mnist", "--method", "safe", "--sparsity", "0.9",
          "--epochs", str(epochs), "--warmup-epochs", "0", "--batch-size", "128",
          "--eval-every", str(epochs), "--bnt-samples", "128",
          "--test-only-split", str(N_TRAIN), str(N_TEST),
          "--data-dir", str(data), "--workdir", str(workdir), "--no-progress"]


def run(layout: str, data: pathlib.Path, workdir: pathlib.Path, epochs: int,
        timeout: float) -> dict:
  """One run of ``layout`` ("1x2": one process, two devices; "2x1": two processes)."""
  env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
  base = command(data, workdir, epochs)
  if layout == "1x2":
    env["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"
    commands = [base]
  else:
    env["XLA_FLAGS"] = "--xla_force_host_platform_device_count=1"
    with socket.socket() as s:
      s.bind(("127.0.0.1", 0))
      port = s.getsockname()[1]
    commands = [base + ["--coordinator", f"127.0.0.1:{port}", "--num-processes", "2",
                        "--process-id", str(i)] for i in range(2)]
  start = time.perf_counter()
  procs = [subprocess.Popen(c, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            text=True) for c in commands]
  try:
    for p in procs:
      _, err = p.communicate(timeout=timeout)
      if p.returncode:
        raise RuntimeError(f"{layout} run failed ({p.returncode}):\n{err[-3000:]}")
  finally:
    for p in procs:
      if p.poll() is None:
        p.kill()
        p.wait()
  with open(workdir / "results.json", encoding="utf-8") as f:
    results = json.load(f)
  return {"steady_images_per_second": results["steady_images_per_second"],
          "wall_seconds": time.perf_counter() - start,
          "device_count": results["versions"]["device_count"],
          "sparse_accuracy": results["final"]["sparse_accuracy"],
          "final_train_loss": results["history"][-1]["train_loss"]}


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--repeats", type=int, default=3)
  parser.add_argument("--epochs", type=int, default=3, help="epochs per run (first compiles)")
  parser.add_argument("--timeout", type=float, default=900, help="seconds per run")
  parser.add_argument("--out", default=str(ROOT / "benchmarks" / "perf" / "results" /
                                            "distributed_overhead.json"))
  args = parser.parse_args()
  start = time.perf_counter()
  report = harness.run_record()
  runs: dict[str, list[dict]] = {"1x2": [], "2x1": []}
  with tempfile.TemporaryDirectory() as tmp:
    data = pathlib.Path(tmp) / "data"
    data.mkdir()
    write_data(data)
    for r in range(args.repeats):
      for layout in ("1x2", "2x1") if r % 2 == 0 else ("2x1", "1x2"):
        out = run(layout, data, pathlib.Path(tmp) / f"{layout}-{r}", args.epochs, args.timeout)
        runs[layout].append(out)
        print(f"repeat {r} {layout}: {out['steady_images_per_second']:.0f} images/s "
              f"(wall {out['wall_seconds']:.1f} s)", flush=True)
  rates = {k: [r["steady_images_per_second"] for r in v] for k, v in runs.items()}
  medians = {k: statistics.median(v) for k, v in rates.items()}
  same = all(a["final_train_loss"] == b["final_train_loss"]
             for a, b in zip(runs["1x2"], runs["2x1"]))
  print("\n| layout | steady images/s (median) | runs |\n|---|---|---|")
  for k, label in (("1x2", "1 process x 2 devices"), ("2x1", "2 processes x 1 device (gloo)")):
    print(f"| {label} | {medians[k]:.0f} | {', '.join(f'{x:.0f}' for x in rates[k])} |")
  ratio = medians["2x1"] / medians["1x2"]
  print(f"\n2 processes / 1 process: {ratio:.2f}x; same final training loss: {same}")
  report.update({
      "benchmark": "distributed_overhead",
      "setup": {"preset": "lenet5-fashion-mnist", "method": "safe", "sparsity": 0.9,
                "batch_size": 128, "epochs": args.epochs, "n_train": N_TRAIN,
                "data": "random 28x28 uint8 images, t10k idx format", "repeats": args.repeats,
                "order": "interleaved, alternating which layout goes first"},
      "runs": runs, "median_steady_images_per_second": medians,
      "ratio_two_processes_to_one": ratio, "same_final_train_loss": same,
      "not_measurable_here": (
          "Interconnect: both layouts share the same 2 CPU cores and the 2-process collectives "
          "run over gloo on loopback TCP; NCCL/NVLink, InfiniBand or TPU ICI all-reduce cost "
          "and its share of a step must be measured on that hardware. On this machine the "
          "two processes also compete for the same cores (and with other load)."),
  })
  harness.write_report(report, args.out, start)


if __name__ == "__main__":
  main()
