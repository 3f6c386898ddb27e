"""Has a sweep converged? The same sweep at two budgets, side by side (the budget-doubling check).

A training loss that flattens at the end of a cosine schedule is not proof
of convergence: the learning rate is near 0 there whatever the budget. The
check that says whether a comparison would change with more training is to
run it again with a longer budget. For two ``sweep.json`` files of
``benchmarks/claims/sparsity_sweep.py`` (the same preset, methods and sparsities;
typically 20 and 40 epochs), this script reports per method and sparsity:

* test accuracy at both budgets (mean ± s.e. over seeds) and the change;
* **stable** when the change is within ``--tolerance`` points and within
  2 s.e. (s.e. of the difference of the two means); **within noise** when it
  is inside 2 s.e. but larger than the tolerance (the seeds' spread hides
  whether it moved, so more seeds or a longer budget are needed before
  calling it converged); else **still moving**;
* the final training loss and ``||x - z||`` at both budgets;
* for each pair of methods, whether their order at every sparsity is the
  same at both budgets (a method conclusion needs that).

It writes ``budget_doubling.json``, ``budget_doubling.md`` and
``budget_doubling.png`` to ``--out``:

  python -m benchmarks.claims.budget_doubling --short results/sparsity_mlp_fmnist/sweep_40epochs.json \\
      --long results/sparsity_mlp_fmnist/sweep_80epochs_s90.json --out /tmp/doubling
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import pathlib
import sys
from typing import Any, Optional

import numpy as np

from safe_optax.experiment import mean_se, versions
from benchmarks import harness


def _groups(sweep: dict[str, Any]) -> dict[tuple[str, float], list[dict[str, Any]]]:
  groups: dict[tuple[str, float], list[dict[str, Any]]] = {}
  for r in sweep["runs"]:
    groups.setdefault((r["method"], float(r["sparsity"])), []).append(r)
  return groups


def _mean(values: list[float]) -> Optional[float]:
  return float(np.mean(values)) if values else None


def verdict(change: float, se: float, tolerance: float) -> str:
  """``stable``, ``within noise`` or ``still moving``: the rule of ``benchmarks/report.py``.

  ``stable`` needs both: a change of at most ``tolerance`` points and at most
  2 s.e. (a small change that every seed makes is still a change); a change
  inside 2 s.e. but above the tolerance is ``within noise``.

  Examples:
    >>> verdict(0.3, 0.2, 0.5), verdict(5.0, 2.9, 0.5), verdict(0.43, 0.12, 0.5)
    ('stable', 'within noise', 'still moving')
  """
  if abs(change) > 2 * se:
    return "still moving"
  return "stable" if abs(change) <= tolerance else "within noise"


def compare(short: dict[str, Any], long: dict[str, Any], tolerance: float = 0.5
            ) -> dict[str, Any]:
  """Per (method, sparsity) in both sweeps: accuracies, the change and whether it is stable.

  Args:
    short: the shorter budget's ``sweep.json`` content.
    long: the longer budget's.
    tolerance: points of accuracy below which a change counts as stable
      (a change within it and within 2 s.e. is stable).

  Returns:
    ``{"rows": [...], "orders": [...], "budgets": [short epochs, long epochs]}``.

  Examples:
    >>> run = lambda m, acc, seed: {"method": m, "sparsity": 0.9, "seed": seed,
    ...                             "accuracy": acc, "final_train_loss": 0.1}
    >>> a = {"config": {"epochs": 20}, "runs": [run("gmp", .90, 0), run("gmp", .90, 1)]}
    >>> b = {"config": {"epochs": 40}, "runs": [run("gmp", .91, 0), run("gmp", .91, 1)]}
    >>> row = compare(a, b)["rows"][0]
    >>> round(row["change"], 2), row["verdict"]
    (1.0, 'still moving')
  """
  g_short, g_long = _groups(short), _groups(long)
  rows = []
  for key in [k for k in g_long if k in g_short]:
    method, sparsity = key
    a = [100 * r["accuracy"] for r in g_short[key]]
    b = [100 * r["accuracy"] for r in g_long[key]]
    (mean_a, se_a), (mean_b, se_b) = mean_se(a), mean_se(b)
    se = math.hypot(se_a or 0.0, se_b or 0.0)
    change = mean_b - mean_a
    rows.append({
        "method": method, "sparsity": sparsity, "seeds": len(b),
        "short": mean_a, "short_se": se_a, "long": mean_b, "long_se": se_b,
        "change": change, "change_se": se,
        "verdict": verdict(change, se, tolerance),
        "loss_short": _mean([r["final_train_loss"] for r in g_short[key]]),
        "loss_long": _mean([r["final_train_loss"] for r in g_long[key]]),
        "distance_short": _mean([r["constraint_distance"] for r in g_short[key]
                                 if r.get("constraint_distance") is not None]),
        "distance_long": _mean([r["constraint_distance"] for r in g_long[key]
                                if r.get("constraint_distance") is not None]),
    })
  orders = []
  methods = list(dict.fromkeys(r["method"] for r in rows if r["method"] != "dense"))
  for m1, m2 in itertools.combinations(methods, 2):
    flips = []
    for s in sorted({r["sparsity"] for r in rows}):
      pair = {r["method"]: r for r in rows if r["sparsity"] == s and r["method"] in (m1, m2)}
      if len(pair) == 2:
        before = np.sign(pair[m1]["short"] - pair[m2]["short"])
        after = np.sign(pair[m1]["long"] - pair[m2]["long"])
        if before != after:
          flips.append(s)
    orders.append({"methods": [m1, m2], "order_changes_at": flips})
  return {"rows": rows, "orders": orders,
          "budgets": [short["config"]["epochs"], long["config"]["epochs"]]}


def markdown(result: dict[str, Any]) -> str:
  """The rows and the order check as markdown tables."""
  def fmt(value, spec):
    return "–" if value is None else format(value, spec)

  short, long = result["budgets"]
  lines = [f"| method | sparsity | {short} epochs | {long} epochs | change (points) | verdict "
           f"| final loss {short} → {long} | ‖x − z‖ {short} → {long} |",
           "|---|---|---|---|---|---|---|---|"]
  for r in result["rows"]:
    lines.append(
        f"| {r['method']} | {100 * r['sparsity']:g}% | {r['short']:.2f} ± {r['short_se'] or 0:.2f} "
        f"| {r['long']:.2f} ± {r['long_se'] or 0:.2f} | {r['change']:+.2f} ± {r['change_se']:.2f} "
        f"| {r['verdict']} | {fmt(r['loss_short'], '.4f')} → {fmt(r['loss_long'], '.4f')} "
        f"| {fmt(r['distance_short'], '.3g')} → {fmt(r['distance_long'], '.3g')} |")
  lines += ["", "| methods | order changes between budgets at |", "|---|---|"]
  for o in result["orders"]:
    where = ", ".join(f"{100 * s:g}%" for s in o["order_changes_at"]) or "nowhere"
    lines.append(f"| {o['methods'][0]} vs {o['methods'][1]} | {where} |")
  return "\n".join(lines)


def plot(result: dict[str, Any], path: pathlib.Path) -> None:
  """Accuracy against sparsity at both budgets (dashed: the shorter one)."""
  from matplotlib.figure import Figure  # pylint: disable=import-outside-toplevel

  fig = Figure(figsize=(7, 4.5))
  ax = fig.subplots()
  sparsities = sorted({r["sparsity"] for r in result["rows"] if r["method"] != "dense"})
  xs = np.arange(len(sparsities))
  short, long = result["budgets"]
  methods = list(dict.fromkeys(r["method"] for r in result["rows"] if r["method"] != "dense"))
  for i, method in enumerate(methods):
    for budget, style in (("short", "--"), ("long", "-")):
      ys = [next((r[budget] for r in result["rows"]
                  if r["method"] == method and r["sparsity"] == s), np.nan) for s in sparsities]
      label = f"{method}, {short if budget == 'short' else long} epochs"
      ax.plot(xs, ys, style, marker="o", color=f"C{i}", label=label)
  ax.set_xticks(xs, [f"{100 * s:g}%" for s in sparsities])
  ax.set_xlabel("sparsity")
  ax.set_ylabel("test accuracy (%)")
  ax.grid(alpha=0.3)
  ax.legend(fontsize=7, ncol=2)
  ax.set_title(f"the same sweep at {short} and {long} epochs")
  fig.tight_layout()
  fig.savefig(path, dpi=100)


def main(argv: Optional[list[str]] = None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--short", required=True, help="sweep.json of the shorter budget")
  parser.add_argument("--long", required=True, help="sweep.json of the longer budget")
  parser.add_argument("--tolerance", type=float, default=0.5,
                      help="largest accuracy change (points) that counts as stable (if also within 2 s.e.)")
  parser.add_argument("--out", required=True)
  args = parser.parse_args(argv)
  sweeps = []
  for path in (args.short, args.long):
    with open(path, encoding="utf-8") as f:
      sweeps.append(json.load(f))
  short, long = sweeps
  if short["config"]["epochs"] >= long["config"]["epochs"]:
    parser.error(f"--short must be the shorter budget, got {short['config']['epochs']} and "
                 f"{long['config']['epochs']} epochs")
  result = compare(short, long, args.tolerance)
  out = pathlib.Path(args.out)
  out.mkdir(parents=True, exist_ok=True)
  command = "python " + " ".join(sys.argv)
  table = markdown(result)
  harness.write_json(out / "budget_doubling.json", {"command": command, "short": args.short, "long": args.long,
       "tolerance": args.tolerance, **result, "versions": versions()})
  (out / "budget_doubling.md").write_text(
      f"Command: `{command}`\n\nTest accuracy (%) of the same sweep at two budgets, mean ± s.e. "
      f"over seeds. **stable**: the change is within {args.tolerance:g} points; **within "
      f"noise**: larger, but inside 2 s.e. of the difference (more seeds or budget needed); "
      f"**still moving**: beyond both.\n\n{table}\n", encoding="utf-8")
  plot(result, out / "budget_doubling.png")
  print(table)
  return 0


if __name__ == "__main__":
  sys.exit(main())
