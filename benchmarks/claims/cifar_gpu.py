"""A time-boxed CIFAR-10 session on one GPU: measured step times, then SAFE / ADMM / GMP runs.

Made for a short GPU lease (minutes, not the hours Table 5 needs), in two phases:

1. ``benchmarks/perf/train_throughput.py --models resnet20x2`` alone on the GPU:
   the median step of SGD, SAM and SAFE (K = 32) at batch 128, the compile
   time, and the epoch / 200-epoch times extrapolated from them. While it
   runs, the CIFAR-10 JPEG archive is decoded once into the ``.npz`` cache on
   the CPU (``SAFE_OPTAX_CACHE``), so the training runs do not race to write it.
2. ``safe-optax-vision train --preset resnet20x2-cifar10`` for SAFE, ADMM and
   GMP at ``--sparsity`` (default 0.9), all processes at once on the one GPU
   (each with ``1 / n`` of its memory), at the paper's recipe except for the
   epoch count: the largest ``E <= 200`` that the measured step times say fits
   before ``--deadline-s``, with the paper's 5 warm-up epochs in 200 scaled to
   ``max(1, round(5 E / 200))`` (0 for a 1-epoch dry run). Three seeds when that still leaves
   ``--min-epochs-3-seeds`` epochs, else seed 0 only. Lambda is the preset's
   (the paper's best for the sparsity; nothing is tuned on the test set here).

Writes under ``--out``: ``cifar_gpu.json`` (device, versions, the plan, and per
run the final and projected test accuracy, the last epoch's training loss,
``||x - Proj(x)||``, the epoch times and images/s), ``train_throughput.json``
and ``runs.tar.gz`` (every run's ``results.json``, ``metrics.jsonl``,
``eval.*``, ``config.json`` and figures; no checkpoints). Runs still going at
the deadline are stopped, and what they logged is packed all the same.

A run of a few dozen epochs is a pipeline check and a timing, not Table 5:
the paper trains 200 epochs and its ADMM-type methods converge over that
schedule. The JSON says which budget ran.

Usage (from the repository root, on the GPU machine)::

  python -m benchmarks.claims.cifar_gpu --data-dir cifar10_jpg.tar.gz --out OUT --deadline-s 480
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import pathlib
import shlex
import subprocess
import sys
import tarfile
import time
from typing import Any

REPO = pathlib.Path(__file__).resolve().parents[2]
from safe_optax.vision import configs
from benchmarks import harness
METHODS = ("safe", "admm", "gmp")
PAPER_EPOCHS = 200
PAPER_WARMUP = 5
STEPS_PER_EPOCH = 391  # ceil(50,000 / 128)
KEEP = ("results.json", "metrics.jsonl", "eval.json", "eval.md", "config.json")


def log(start: float, text: str) -> None:
  print(f"[{time.perf_counter() - start:6.1f} s] {text}", flush=True)


def environment() -> dict[str, Any]:
  """GPU name, driver and the Python packages, as the runs see them."""
  try:
    smi = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total",
                          "--format=csv,noheader"], capture_output=True, text=True,
                         timeout=30).stdout.strip()
  except (OSError, subprocess.TimeoutExpired) as error:
    smi = f"nvidia-smi unavailable: {error}"
  probe = ("import json, jax, safe_optax.experiment as e; v = e.versions('tqdm', 'pillow'); "
           "v['devices'] = [str(d) for d in jax.devices()]; print(json.dumps(v))")
  out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                       env=_env(), cwd=REPO, timeout=300)
  try:
    found = json.loads(out.stdout.strip().splitlines()[-1])
  except (IndexError, json.JSONDecodeError):
    found = {"error": out.stderr[-2000:]}
  return {"nvidia_smi": smi, "versions": found}


def gpu_sample() -> str:
  """``utilization.gpu, memory.used`` from nvidia-smi, or '' without one."""
  try:
    return subprocess.run(["nvidia-smi", "--query-gpu=utilization.gpu,memory.used",
                           "--format=csv,noheader,nounits"], capture_output=True, text=True,
                          timeout=10).stdout.strip()
  except (OSError, subprocess.TimeoutExpired):
    return ""


def _env(**extra: str) -> dict[str, str]:
  env = dict(os.environ)
  env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
  env["PYTHONUNBUFFERED"] = "1"
  env.update(extra)
  return env


def warmup_for(epochs: int) -> int:
  """The paper's 5 warm-up epochs in 200, scaled to ``epochs``: at least 1, fewer than ``epochs``.

  Examples:
    >>> [warmup_for(e) for e in (1, 2, 30, 200)]
    [0, 1, 1, 5]
  """
  return min(max(1, round(PAPER_WARMUP * epochs / PAPER_EPOCHS)), epochs - 1)


def plan_epochs(throughput: dict[str, Any], seconds: float, min_epochs_3_seeds: int,
                overhead: float) -> dict[str, Any]:
  """The epoch count and seeds that fit ``seconds`` of training, from measured step times.

  The processes share one GPU. The plan assumes sharing gains nothing (the GPU
  runs one process's kernels at a time), so an epoch of all runs costs the sum
  of their solo epochs, times ``overhead`` for the input pipeline, evaluation
  and checkpoints. ADMM and GMP take one forward-backward pass a step, like SGD.

  Examples:
    >>> t = {"methods": {"sgd": {"epoch_s": 2.0}, "safe": {"epoch_s": 4.0}}}
    >>> plan = plan_epochs(t, 1200.0, 20, 1.25)
    >>> plan["epochs"], plan["seeds"]
    (40, [0, 1, 2])
    >>> plan_epochs(t, 300.0, 20, 1.25)["seeds"]
    [0]
    >>> plan_epochs(t, 10.0, 20, 1.25)["epochs"]
    1
  """
  epoch = {"safe": throughput["methods"]["safe"]["epoch_s"],
           "admm": throughput["methods"]["sgd"]["epoch_s"],
           "gmp": throughput["methods"]["sgd"]["epoch_s"]}
  per_seed = overhead * sum(epoch[m] for m in METHODS)
  seeds = [0, 1, 2]
  epochs = math.floor(seconds / (3 * per_seed))
  if epochs < min_epochs_3_seeds:
    seeds = [0]
    epochs = math.floor(seconds / per_seed)
  epochs = max(1, min(PAPER_EPOCHS, epochs))
  return {"epochs": epochs, "seeds": seeds,
          "warmup_epochs": warmup_for(epochs), "solo_epoch_s": epoch,
          "planned_shared_epoch_s": per_seed * len(seeds),
          "training_seconds_available": seconds, "overhead_factor": overhead}


def summarise_run(workdir: pathlib.Path) -> dict[str, Any]:
  """Final numbers of one run, or what its per-epoch log holds when it did not finish."""
  entry: dict[str, Any] = {"finished": (workdir / "results.json").exists()}
  epochs = []
  if (workdir / "metrics.jsonl").exists():
    for line in (workdir / "metrics.jsonl").read_text().splitlines():
      try:
        record = json.loads(line)
      except json.JSONDecodeError:  # a line still being written
        continue
      if "epoch_seconds" in record:
        epochs.append(record)
  if epochs:
    last = epochs[-1]
    entry.update(epochs_done=len(epochs), last_train_loss=last.get("train_loss"),
                 last_distance_to_projection=last.get("distance_to_projection"),
                 epoch_seconds=[e["epoch_seconds"] for e in epochs],
                 train_loss=[e.get("train_loss") for e in epochs])
  if entry["finished"]:
    try:
      result = json.loads((workdir / "results.json").read_text())
    except json.JSONDecodeError:  # still being written
      entry["finished"] = False
      return entry
    entry.update(final=result.get("final"), wall_seconds=result.get("wall_seconds"),
                 train_seconds=result.get("train_seconds"),
                 images_per_second=result.get("images_per_second"),
                 steady_images_per_second=result.get("steady_images_per_second"))
  return entry


def pack(root: pathlib.Path, target: pathlib.Path) -> None:
  """The runs' small outputs (no checkpoints) and logs in one archive."""
  with tarfile.open(target, "w:gz") as tar:
    for path in sorted(root.rglob("*")):
      if path.is_file() and (path.name in KEEP or path.suffix in (".png", ".log")
                             ) and "checkpoints" not in path.parts:
        tar.add(path, arcname=str(path.relative_to(root)))


def merge_leases(inputs: list[pathlib.Path], out: pathlib.Path) -> str:
  """Merges the outputs of one or more leases into ``table.md``, ``runs.json`` and a figure.

  Each input is a folder with a lease's ``cifar_gpu.json`` and ``runs.tar.gz``;
  the runs are unpacked into ``out/runs``. Accuracies are the test set's, after
  the final projection and BNT (``sparse_accuracy``); a dense run's is its own.
  """
  import matplotlib  # pylint: disable=import-outside-toplevel
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=import-outside-toplevel
  from safe_optax.experiment import mean_se  # pylint: disable=import-outside-toplevel

  (out / "runs").mkdir(parents=True, exist_ok=True)
  leases, runs = [], {}
  for folder in inputs:
    lease = json.loads((folder / "cifar_gpu.json").read_text())
    with tarfile.open(folder / "runs.tar.gz") as tar:
      harness.extract_tar(tar, out / "runs", str(folder / "runs.tar.gz"))
    leases.append({k: lease.get(k) for k in ("command", "date", "nvidia_smi", "versions",
                                             "plan", "run_commands", "wall_seconds")})
    for name in lease["runs"]:
      method, seed = name.rsplit("-seed", 1)
      workdir = next((out / "runs").glob(f"{method}-s*-seed{seed}"))
      run = summarise_run(workdir)
      run["epochs_log"] = [json.loads(line) for line in
                           (workdir / "metrics.jsonl").read_text().splitlines()]
      run["lease"] = len(leases) - 1
      runs.setdefault(method, {})[int(seed)] = run
  epochs = {r["epochs_done"] for m in runs.values() for r in m.values()}
  device = leases[0]["nvidia_smi"]

  def accuracy(method: str, run: dict[str, Any]) -> float:
    final = run["final"]
    return 100 * final["dense_accuracy" if method == "dense" else "sparse_accuracy"]

  epoch_text = ", ".join(map(str, sorted(epochs)))
  lines = [f"# CIFAR-10, ResNet-20x2, on one GPU ({device})", "",
           f"Epochs: {epoch_text} (the paper: 200). Test accuracy (%) after the final "
           "projection and BNT on 10k training images; mean +- s.e. over the seeds listed. "
           "`||x - Proj x||` and the training loss are the last epoch's.", "",
           "| method | seeds | test accuracy | per seed | dense iterate | before BNT "
           "| train loss | `||x - Proj x||` | steady images/s |",
           "|---|---|---|---|---|---|---|---|---|"]
  for method, by_seed in runs.items():
    seeds = sorted(by_seed)
    accs = [accuracy(method, by_seed[s]) for s in seeds]
    mean, se = mean_se(accs)
    cell = f"{mean:.2f}" + (f" +- {se:.2f}" if se is not None else "")

    def per(key: str) -> str:
      vals = [by_seed[s]["final"].get(key) for s in seeds]
      return " / ".join("-" if v is None else f"{100 * v:.2f}" for v in vals)
    def last(key: str) -> str:
      return " / ".join("-" if by_seed[s].get(key) is None else f"{by_seed[s][key]:.3g}"
                        for s in seeds)
    speed = " / ".join(f"{by_seed[s].get('steady_images_per_second') or 0:.0f}" for s in seeds)
    lines.append(
        f"| {method} | {', '.join(map(str, seeds))} | {cell} | "
        f"{' / '.join(f'{a:.2f}' for a in accs)} | {per('dense_accuracy')} | "
        f"{per('sparse_accuracy_before_bnt')} | {last('last_train_loss')} | "
        f"{last('last_distance_to_projection')} | "
        f"{speed} |")
  table = "\n".join(lines) + "\n"
  (out / "table.md").write_text(table)
  summary_runs = {m: {seed: {k: v for k, v in run.items() if k != "epochs_log"}
                      for seed, run in by_seed.items()} for m, by_seed in runs.items()}
  harness.write_json(out / "runs.json", {"leases": leases, "runs": summary_runs})

  fig, axes = plt.subplots(1, 3, figsize=(15, 4))
  for (method, by_seed), color in zip(runs.items(), ("C0", "C1", "C2", "C3", "C4")):
    for seed, run in sorted(by_seed.items()):
      log_ = [r for r in run["epochs_log"] if "epoch_seconds" in r]
      label = f"{method}" if seed == min(by_seed) else None
      axes[0].plot([r["epoch"] + 1 for r in log_], [r["train_loss"] for r in log_],
                   color=color, label=label, alpha=0.8)
      tested = [r for r in log_ if "test_accuracy" in r]
      key = "test_accuracy" if method == "dense" else "test_accuracy_projected"
      axes[1].plot([r["epoch"] + 1 for r in tested], [100 * r[key] for r in tested], "o-",
                   color=color, label=label, alpha=0.8)
      if method != "dense":
        axes[2].semilogy([r["epoch"] + 1 for r in log_],
                         [max(r["distance_to_projection"], 1e-3) for r in log_],
                         color=color, label=label, alpha=0.8)
  axes[0].set(xlabel="epoch", ylabel="training loss", title="training loss")
  axes[1].set(xlabel="epoch", ylabel="test accuracy (%)",
              title="test accuracy of Proj(x) (dense: x), before BNT")
  axes[2].set(xlabel="epoch", ylabel="||x - Proj x|| (floored at 1e-3)",
              title="distance to the sparse set")
  for ax in axes:
    ax.legend()
    ax.grid(alpha=0.3)
  fig.suptitle(f"ResNet-20x2, CIFAR-10, {epoch_text} epochs, 90 % sparsity, {device}")
  fig.tight_layout()
  fig.savefig(out / "curves.png", dpi=110)
  plt.close(fig)
  return table


def main(argv: list[str] | None = None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--data-dir", help="CIFAR-10 archive or folder (required to train)")
  parser.add_argument("--out", required=True, help="folder for the JSON and the archive")
  parser.add_argument("--workdir", default="/tmp/cifar_gpu", help="runs and caches")
  parser.add_argument("--deadline-s", type=float, default=480.0,
                      help="every run ends (or is stopped) this many seconds after the start")
  parser.add_argument("--sparsity", type=float, default=0.9)
  parser.add_argument("--methods", nargs="+", default=list(METHODS), choices=configs.METHODS,
                      help="methods to train (the plan is sized for SAFE, ADMM and GMP; "
                           "with --epochs any of the CLI's, e.g. dense as a calibration)")
  parser.add_argument("--throughput-steps", type=int, default=20)
  parser.add_argument("--min-epochs-3-seeds", type=int, default=40,
                      help="three seeds only if each still gets this many epochs")
  parser.add_argument("--startup-s", type=float, default=None,
                      help="seconds a run spends before its first epoch (default: twice the "
                           "measured SAFE compile + 30 s)")
  parser.add_argument("--finish-s", type=float, default=60.0,
                      help="seconds a run spends after its last epoch (BNT, evaluation, files)")
  parser.add_argument("--overhead", type=float, default=1.3,
                      help="shared-epoch time over the sum of the solo step times")
  parser.add_argument("--fallback-epochs", type=int, default=10,
                      help="epochs (seed 0) when the throughput benchmark fails")
  parser.add_argument("--epochs", type=int, default=None,
                      help="skip the plan: this many epochs (a CPU dry run uses 1)")
  parser.add_argument("--train-subset", type=int, default=None, help="CPU dry runs only")
  parser.add_argument("--seeds", type=int, nargs="+", default=None, help="with --epochs")
  parser.add_argument("--report-from", nargs="+", default=None, metavar="LEASE_OUT",
                      help="train nothing: merge these lease outputs into --out (table.md, "
                           "runs.json, curves.png)")
  args = parser.parse_args(argv)
  if args.report_from:
    print(merge_leases([pathlib.Path(p) for p in args.report_from], pathlib.Path(args.out)))
    return
  if not args.data_dir:
    parser.error("--data-dir is required to train (or give --report-from)")
  if not 0.0 < args.sparsity < 1.0:
    parser.error(f"--sparsity must lie in (0, 1), got {args.sparsity}")
  if args.deadline_s <= 0:
    parser.error(f"--deadline-s must be > 0 seconds, got {args.deadline_s}")
  if args.epochs is not None and args.epochs < 1:
    parser.error(f"--epochs must be >= 1, got {args.epochs}")
  for flag, value, low in (("--throughput-steps", args.throughput_steps, 1),
                           ("--min-epochs-3-seeds", args.min_epochs_3_seeds, 1),
                           ("--fallback-epochs", args.fallback_epochs, 1),
                           ("--finish-s", args.finish_s, 0), ("--startup-s", args.startup_s, 0),
                           ("--overhead", args.overhead, 1)):
    if value is not None and value < low:
      parser.error(f"{flag} must be >= {low}, got {value}")
  if args.seeds is not None and args.epochs is None:
    parser.error("--seeds needs --epochs (without it the plan chooses the seeds)")

  start = time.perf_counter()
  out = pathlib.Path(args.out)
  out.mkdir(parents=True, exist_ok=True)
  work = pathlib.Path(args.workdir)
  (work / "runs").mkdir(parents=True, exist_ok=True)
  cache = work / "cache"
  report: dict[str, Any] = {
      "command": shlex.join([sys.executable] + sys.argv),
      "date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
      "note": ("time-boxed run on a lent GPU: a pipeline check and a timing at the "
               "epochs below, not the paper's 200-epoch Table 5"),
  }
  report.update(environment())
  log(start, f"environment: {report['nvidia_smi']}; jax "
      f"{report['versions'].get('jax')} on {report['versions'].get('devices')}")

  decode = subprocess.Popen(
      [sys.executable, "-c", "import sys; from safe_optax.vision import input_pipeline as p; "
       "d = p.load_cifar(sys.argv[1]); print('decoded', d.train_images.shape)",
       args.data_dir], env=_env(JAX_PLATFORMS="cpu", SAFE_OPTAX_CACHE=str(cache)), cwd=REPO)
  throughput_json = out / "train_throughput.json"
  if args.epochs is None:
    measured = subprocess.run(
        [sys.executable, "benchmarks/perf/train_throughput.py", "--models", "resnet20x2",
         "--steps", str(args.throughput_steps), "--warmup", "3", "--dual-steps", "3",
         "--out", str(throughput_json)], env=_env(), cwd=REPO)
    if decode.wait() != 0:
      raise SystemExit("decoding the CIFAR archive failed")
    if measured.returncode == 0:
      throughput = json.loads(throughput_json.read_text())["models"]["resnet20x2"]
      compile_s = max(m["first_call_s"] for m in throughput["methods"].values())
      startup = args.startup_s if args.startup_s is not None else 2 * compile_s + 30
      left = args.deadline_s - (time.perf_counter() - start) - startup - args.finish_s
      plan = plan_epochs(throughput, left, args.min_epochs_3_seeds, args.overhead)
      plan["startup_s_assumed"] = startup
    else:  # still train, on a guess, so the lease is not lost to a benchmark's failure
      plan = {"epochs": args.fallback_epochs, "seeds": [0],
              "warmup_epochs": warmup_for(args.fallback_epochs),
              "throughput_failed": measured.returncode}
    log(start, f"plan {plan}")
  else:
    if decode.wait() != 0:
      raise SystemExit("decoding the CIFAR archive failed")
    plan = {"epochs": args.epochs, "seeds": args.seeds or [0],
            "warmup_epochs": warmup_for(args.epochs)}
  report["plan"] = plan

  runs = [(method, seed) for seed in plan["seeds"] for method in args.methods]
  fraction = f"{0.9 / len(runs):.3f}"
  procs = {}
  for method, seed in runs:
    workdir = work / "runs" / f"{method}-s{args.sparsity}-seed{seed}"
    command = [sys.executable, "-m", "safe_optax.vision.cli", "train",
               "--preset", "resnet20x2-cifar10", "--method", method,
               "--sparsity", str(args.sparsity), "--seed", str(seed),
               "--epochs", str(plan["epochs"]), "--warmup-epochs", str(plan["warmup_epochs"]),
               "--eval-every", str(max(1, plan["epochs"] // 4)),
               "--data-dir", args.data_dir, "--workdir", str(workdir), "--no-progress",
               "--restart"]
    if args.train_subset:
      command += ["--train-subset", str(args.train_subset), "--test-subset", "500",
                  "--bnt-samples", "500"]
    workdir.mkdir(parents=True, exist_ok=True)
    handle = open(workdir / "train.log", "w")
    procs[(method, seed)] = (subprocess.Popen(
        command, env=_env(SAFE_OPTAX_CACHE=str(cache), XLA_PYTHON_CLIENT_MEM_FRACTION=fraction,
                          JAX_COMPILATION_CACHE_DIR=str(work / "jax_cache")),
        cwd=REPO, stdout=handle, stderr=subprocess.STDOUT), handle, workdir)
  log(start, f"started {len(runs)} runs: {plan['epochs']} epochs, seeds {plan['seeds']}")
  report["run_commands"] = {f"{m}-seed{s}": shlex.join(p.args) for (m, s), (p, _, _)
                            in procs.items()}

  def write() -> None:  # also while the runs go on: a lease cut short still returns them
    report["runs"] = {f"{m}-seed{s}": {"returncode": p.poll(), **summarise_run(w)}
                      for (m, s), (p, _, w) in procs.items()}
    report["wall_seconds"] = time.perf_counter() - start
    harness.write_json(out / "cifar_gpu.json", report)
    pack(work / "runs", out / "runs.tar.gz")

  stopped: list[str] = []
  report["stopped_at_deadline"] = stopped
  report["gpu_utilization"] = []  # (seconds since start, utilization.gpu %, memory.used MiB)
  last_write = time.perf_counter()
  while any(p.poll() is None for p, _, _ in procs.values()):
    if time.perf_counter() - start > args.deadline_s:
      for key, (p, _, _) in procs.items():
        if p.poll() is None:
          p.terminate()
          stopped.append(f"{key[0]}-seed{key[1]}")
      break
    time.sleep(5)
    report["gpu_utilization"].append([round(time.perf_counter() - start, 1), gpu_sample()])
    if time.perf_counter() - last_write > 60:
      write()
      last_write = time.perf_counter()
  for p, handle, _ in procs.values():
    try:
      p.wait(timeout=30)
    except subprocess.TimeoutExpired:
      p.kill()
    handle.close()
  write()
  for key, run in report["runs"].items():
    final = run.get("final") or {}
    log(start, f"{key}: rc {run['returncode']}, epochs {run.get('epochs_done')}, "
        f"final {json.dumps(final)[:300]}")
  log(start, f"wrote {out / 'cifar_gpu.json'} and {out / 'runs.tar.gz'}")


if __name__ == "__main__":
  main()
