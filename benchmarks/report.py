"""The evidence report: ``results/README.md`` and README.md's evidence summary, from the claim folders.

Every number in the report comes from the JSON files in ``results/<claim>/``
(read by ``report_sources``); the verdict of each row follows from the rules
declared once below, in code, and printed at the top of the report.

  python -m benchmarks.report           # write results/README.md and README.md's evidence block
  python -m benchmarks.report --check   # exit 1 when either differs from what the JSON gives
"""

from __future__ import annotations

import os
import subprocess
import sys

if __name__ == "__main__" and not __package__:
  # `python benchmarks/report.py`: run as the package module it is (`python -m benchmarks.report`),
  # with the repository root importable in that process only; arguments and the working
  # directory are the caller's.
  _ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  _PATH = os.pathsep.join(filter(None, [_ROOT, os.environ.get("PYTHONPATH")]))
  sys.exit(subprocess.call([sys.executable, "-m", "benchmarks.report", *sys.argv[1:]],
                           env={**os.environ, "PYTHONPATH": _PATH}))

import argparse
import dataclasses
import difflib
import json
import math
import pathlib
import re
from typing import Optional, Sequence

from benchmarks import report_sources
from benchmarks.claims import tuning
from benchmarks.report_sources import Arm, Row

ROOT = pathlib.Path(__file__).resolve().parents[1]
RESULTS = ROOT / "results"
START, END = "<!-- evidence:start -->", "<!-- evidence:end -->"

# The verdict rules: the only place their thresholds live.
HOLD_SE = 2.0            # a difference counts when it exceeds this many standard errors
SEEDS_AGAINST = 1        # ... and its sign holds in every seed but at most this many
STABLE_POINTS = 0.5      # converged: doubling the budget moves each method by at most this ...
STABLE_SE = 2.0          # ... and by at most this many standard errors of the change
SPARSE_SET_DISTANCE = 1.0  # ... and each ADMM-type iterate ends within this ||x - z|| of its sparse set
ADMM_TYPE = ("SAFE", "SAFE+", "ADMM")
ONE_SHOT = ("magnitude", "Wanda", "SparseGPT", "dense")  # no training budget to double
DIVERGED = 10.0          # a diverged run scores chance accuracy on the 10-class tasks


@dataclasses.dataclass(frozen=True)
class Stat:
  mean: float
  se: Optional[float]  # None with one seed
  n: int


def stat(values: Sequence[float]) -> Stat:
  """Mean and standard error (sample standard deviation / sqrt(n))."""
  n = len(values)
  mean = math.fsum(values) / n
  if n < 2:
    return Stat(mean, None, n)
  var = math.fsum((v - mean) ** 2 for v in values) / (n - 1)
  return Stat(mean, math.sqrt(var / n), n)


def scored(values: dict[int, Optional[float]]) -> dict[int, float]:
  """Each seed's value, a diverged run (None) scored as chance."""
  return {s: DIVERGED if v is None else v for s, v in values.items()}


def paired(a: dict[int, Optional[float]], b: dict[int, Optional[float]]) -> list[float]:
  """Per-seed differences a - b over the seeds both have."""
  a, b = scored(a), scored(b)
  seeds = sorted(set(a) & set(b))
  if not seeds:
    raise ValueError("no seed in common: a paired difference needs the same seeds")
  return [a[s] - b[s] for s in seeds]


def verdict(diffs: Sequence[float]) -> str:
  """``holds``, ``level``, ``reversed`` or ``fails`` for per-seed differences (positive: ours better).

  Examples:
    >>> verdict([1.0, 1.2, 0.9]), verdict([0.1, -0.1, 0.05]), verdict([-1.0, -1.1, -0.9])
    ('holds', 'level', 'reversed')
  """
  s = stat(diffs)
  if s.se is None:
    return "no verdict (one seed)"
  if abs(s.mean) <= HOLD_SE * s.se:
    return "level"
  sign = 1.0 if s.mean > 0 else -1.0
  against = sum(1 for d in diffs if d * sign <= 0)
  if against > SEEDS_AGAINST:
    return "fails"
  return "holds" if sign > 0 else "reversed"


def convergence(arms: Sequence[Arm], points: bool, digits: int = 2) -> str:
  """``converged`` or what stops it: a method that moved, a missing shorter run, a far iterate.

  ``digits``: the row's, for the change a method made.
  """
  problems = []
  for arm in arms:
    if arm.name in ONE_SHOT:
      continue
    if arm.shorter is None:
      problems.append(f"{arm.name}: no shorter run")
      continue
    if not arm.shorter_same_hyper:
      problems.append(f"{arm.name}: shorter run used other hyperparameters")
      continue
    change = stat(paired(arm.values, arm.shorter.values))
    moved = (change.se is None or abs(change.mean) > STABLE_SE * change.se
             or (points and abs(change.mean) > STABLE_POINTS))
    if moved:
      problems.append(f"{arm.name} {change.mean:+.{digits}f} ± {_num(change.se, digits)} "
                      f"vs {arm.shorter.budget}")
  for arm in arms:
    if arm.name in ADMM_TYPE and arm.distance is not None and arm.distance > SPARSE_SET_DISTANCE:
      problems.append(f"{arm.name} ||x − z|| {arm.distance:.2f}")
  if not points and not problems:
    problems.append("not an accuracy: no budget rule")
  return "converged" if not problems else "not shown: " + "; ".join(problems)


def check_budgets(row: Row) -> None:
  """Methods are compared at one budget: a row that mixes budgets is an error."""
  budgets = {arm.budget for arm in (row.ours, *row.baselines)}
  if len(budgets) != 1:
    raise ValueError(f"row {row.label!r} mixes budgets {sorted(budgets)}")


def anchor(heading: str) -> str:
  """GitHub's anchor of a Markdown heading (headings here carry no `_`, `*` or backticks)."""
  if re.search(r"[`*_]", heading):
    raise ValueError(f"a claim title must not contain `, * or _: {heading!r}")
  return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _num(x: Optional[float], digits: int) -> str:
  return "–" if x is None else f"{x:.{digits}f}"


def _mean_se(values: dict[int, Optional[float]], digits: int) -> str:
  if not values:
    return "pending"
  s = stat(list(scored(values).values()))
  diverged = sum(1 for v in values.values() if v is None)
  note = f" ({diverged} of {s.n} diverged)" if diverged else ""
  if s.se is None:
    return f"{s.mean:.{digits}f} (1 seed){note}"
  return f"{s.mean:.{digits}f} ± {s.se:.{digits}f}{note}"


def _hyper(arm: Arm) -> str:
  text = "; ".join(arm.hyper) if arm.hyper else "none"
  return f"{arm.name}: {text}"


def fewer_values(arm: Arm, other: Arm) -> list[str]:
  """Why ``arm``'s main hyperparameter had a smaller grid than ``other``'s (empty: not smaller).

  Examples:
    >>> safe, gmp = Arm("SAFE", {}, "", effort=3), Arm("GMP", {}, "", effort=0)
    >>> fewer_values(gmp, safe), fewer_values(safe, gmp)
    (['GMP not tuned'], [])
  """
  if arm.effort is None or other.effort is None or arm.effort >= other.effort:
    return []  # None: a one-shot method, nothing to tune
  if arm.effort == 0:
    return [f"{arm.name} not tuned"]
  return [f"{arm.name}'s {tuning.MAIN[arm.name]} from {arm.effort} values, {other.name}'s "
          f"{tuning.MAIN[other.name]} from {other.effort}"]


@dataclasses.dataclass
class Line:
  row: Row
  baseline: Arm
  diff: Optional[Stat]  # None while the row is pending
  won: int
  verdict: str
  convergence: str


def lines(row: Row) -> list[Line]:
  check_budgets(row)
  missing = [arm.name for arm in (row.ours, *row.baselines) if not arm.values]
  if missing:
    # A row whose runs are not all done yet shows as pending, never as a partial comparison.
    return [Line(row, base, None, 0, "pending: " + ", ".join(missing) + " not run yet", "pending")
            for base in row.baselines]
  sign = 1.0 if row.higher_is_better else -1.0
  status = convergence([row.ours, *row.baselines], row.points, row.digits)
  out = []
  for base in row.baselines:
    diffs = [sign * d for d in paired(row.ours.values, base.values)]
    v = verdict(diffs)
    base_less = fewer_values(base, row.ours) + base.unfinished
    ours_less = fewer_values(row.ours, base) + row.ours.unfinished
    # A win over a method tuned with less effort (or a loss to one tuned with more) is not evidence.
    if (v == "holds" and base_less) or (v == "reversed" and ours_less):
      v = "unequal tuning"
    both = row.ours.flags | base.flags
    flags = list(dict.fromkeys(base_less + ours_less)) + [
        f for f, on in (("a setting not chosen", "unchosen" in both),
                        (f"NOT EVIDENCE: {row.note}", bool(row.note))) if on]
    if flags:
      v += " (" + ", ".join(flags) + ")"
    out.append(Line(row, base, stat(diffs), sum(1 for d in diffs if d > 0), v, status))
  return out


def rules_text() -> str:
  return "\n".join([
      "## How each verdict is decided",
      "",
      "The generator (`benchmarks/report.py`) applies these rules to every row; no verdict is "
      "written by hand.",
      "",
      "- The difference is paired: ours minus the baseline in each seed, signed so that positive "
      "means ours is better; its mean ± standard error is over those seeds.",
      f"- **holds**: the difference exceeds {HOLD_SE:g} s.e. and its sign holds in every seed but "
      f"at most {SEEDS_AGAINST}.",
      f"- **level**: the difference is within {HOLD_SE:g} s.e.",
      f"- **reversed**: the difference is below −{HOLD_SE:g} s.e. with the same seed rule "
      "(the baseline is better); **fails**: beyond "
      f"{HOLD_SE:g} s.e. but more than {SEEDS_AGAINST} seed disagrees.",
      "- With one seed there is no standard error and no verdict. A row with a method not yet "
      "run is **pending**: none of its numbers is compared.",
      f"- A run that diverged scores {DIVERGED:g} % (chance on these 10-class tasks) and is "
      "counted as diverged beside the mean.",
      f"- **converged**: every compared method that trains (all but the one-shot "
      f"{', '.join(ONE_SHOT)}) has a run at a shorter budget with the same "
      f"hyperparameters, and going from it to this budget moved each by at most "
      f"{STABLE_POINTS:g} points and at most {STABLE_SE:g} s.e. of the change; and every "
      f"ADMM-type iterate ({', '.join(ADMM_TYPE)}) ends within `||x − z||` ≤ "
      f"{SPARSE_SET_DISTANCE:g} of its sparse set. Otherwise the column says what is missing.",
      "- Methods in a row share one budget: the generator refuses a row that mixes budgets. A "
      "row that repeats another at a shorter budget is shown, and the README's summary counts "
      "the comparison once, at the longer budget.",
      "- **unequal tuning**: the difference would hold, but the baseline was tuned with less "
      "effort than ours by the rule declared in `benchmarks/claims/tuning.py` (or it would be "
      "reversed, and ours was tuned with less). Equal effort: " + tuning.EQUAL_EFFORT + " The edge rule: "
      + tuning.EDGE_RULE + " The reasons follow the verdict; a level or failed row names them too.",
      "- Hyperparameters: `λ 0.01 ∈ {0.003, 0.01} on validation (file)` was chosen on the "
      "validation split recorded in that file's `selection`, from that grid (every grid is "
      "checked against its declaration in `benchmarks/claims/tuning.py`); AT GRID EDGE marks a "
      "choice at either end of its grid, NOT CHOSEN a value given without a choice (a grid of one "
      "value or the paper's value), NOT TUNED a baseline run with its defaults. The verdict names "
      "each of these after it; 〃 repeats the line above. A row marked NOT EVIDENCE (a pipeline "
      "check, a grid informed by the test set) is shown for completeness only.",
  ])


def claim_section(folder: pathlib.Path, claim: report_sources.Claim) -> tuple[str, list[Line]]:
  all_lines = [line for row in claim.rows for line in lines(row)]
  out = [f"## {claim.title}", "",
         f"Folder `results/{folder.name}/`; regenerate with `sh results/{folder.name}/run.sh`. "
         f"The paper: {claim.paper}. Metric: {claim.metric}, "
         f"{'higher' if claim.higher_is_better else 'lower'} is better; mean ± s.e. over seeds.",
         "",
         "| row | paper | ours | baseline | difference | seeds won | budget | hyperparameters "
         "| convergence | verdict |",
         "|---|---|---|---|---|---|---|---|---|---|"]
  previous = None
  for line in all_lines:
    row, base, d = line.row, line.baseline, line.diff
    first = row is not previous
    previous = row
    diff = "–" if d is None else (
        f"{d.mean:+.{row.digits}f}" + ("" if d.se is None else f" ± {d.se:.{row.digits}f}"))
    hyper = (f"{_hyper(row.ours)}. " if first else "") + _hyper(base)
    out.append(" | ".join([
        f"| {row.label if first else '〃'}", (row.paper or "–") if first else "〃",
        f"{row.ours.name} {_mean_se(row.ours.values, row.digits)}" if first else "〃",
        f"{base.name} {_mean_se(base.values, row.digits)}", diff,
        "–" if d is None else f"{line.won} of {d.n}", row.ours.budget if first else "〃", hyper,
        line.convergence if first else "〃", f"**{line.verdict}** |"]))
  out += ["", f"- Tuning declared in `benchmarks/claims/tuning.py`, "
          f"{tuning.DECLARED[folder.name]['when']}."]
  out += [f"- {with_verdicts(c, all_lines)}" for c in claim.caveats]
  return "\n".join(out), all_lines


def with_verdicts(text: str, all_lines: list[Line]) -> str:
  """A caveat with each ``{verdict: <row label>}`` replaced by that row's generated verdicts.

  So a claim's text can say what a row shows without restating it by hand.
  """
  def verdicts(match: re.Match) -> str:
    label = match.group(1).strip()
    found = [f"against {line.baseline.name} **{line.verdict}**" for line in all_lines
             if line.row.label == label]
    if not found:
      raise ValueError(f"a caveat names row {label!r}, which the claim does not have")
    return ", ".join(found)
  return re.sub(r"\{verdict:([^}]*)\}", verdicts, text)


def summary_line(claim: report_sources.Claim, all_lines: list[Line]) -> str:
  """One line per claim: how many rows each verdict got against each baseline.

  A row that repeats another at a shorter budget (``budget_check``) is counted once, at the
  longer budget, and the line says how many were left out.
  """
  kinds = ("holds", "level", "reversed", "fails", "unequal tuning", "no verdict", "pending")
  checks = {id(line.row) for line in all_lines if line.row.budget_check}
  all_lines = [line for line in all_lines if id(line.row) not in checks]
  parts = []
  for name in dict.fromkeys(line.baseline.name for line in all_lines):
    verdicts = [line.verdict for line in all_lines if line.baseline.name == name]
    counts = [(k, sum(1 for v in verdicts if v.startswith(k))) for k in kinds]
    parts.append(f"vs {name}: " + ", ".join(f"{k} {n}" for k, n in counts if n))
  status = {id(line.row): line.convergence for line in all_lines}
  converged = sum(1 for c in status.values() if c == "converged")
  shorter = f"; {len(checks)} at shorter budgets not counted" if checks else ""
  return (f"- [{claim.short}](results/README.md#{anchor(claim.title)}): " + "; ".join(parts)
          + f" (rows converged: {converged} of {len(status)}{shorter})")


def build(results: pathlib.Path = RESULTS) -> tuple[str, str]:
  """The report's text and the README's evidence block."""
  sections, summary = [], []
  for folder in sorted(p for p in results.iterdir() if (p / "claim.json").is_file()):
    claim = report_sources.load_claim(folder)
    text, all_lines = claim_section(folder, claim)
    sections.append((claim.order, text))
    summary.append((claim.order, summary_line(claim, all_lines)))
  report = "\n\n".join([
      "# Evidence: the paper's claims, checked against the committed runs",
      "Generated by `python -m benchmarks.report` from the JSON files in each folder below; "
      "do not edit by hand (`python -m benchmarks.report --check` fails when this file differs "
      "from what the JSON gives).",
      rules_text()] + [text for _, text in sorted(sections)]) + "\n"
  block = "\n".join([START, *(line for _, line in sorted(summary)), END])
  return report, block


def readme_with(readme: str, block: str) -> str:
  if START not in readme or END not in readme:
    raise ValueError(f"README.md has no {START} ... {END} markers")
  head, rest = readme.split(START, 1)
  _, tail = rest.split(END, 1)
  return head + block + tail


def main(argv: Optional[Sequence[str]] = None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--check", action="store_true",
                      help="compare with the committed files instead of writing them")
  parser.add_argument("--root", default=str(ROOT), help="repository root (for tests)")
  args = parser.parse_args(argv)
  root = pathlib.Path(args.root)
  report, block = build(root / "results")
  readme_path, report_path = root / "README.md", root / "results" / "README.md"
  readme = readme_with(readme_path.read_text(encoding="utf-8"), block)
  if args.check:
    stale = [(p, want) for p, want in ((report_path, report), (readme_path, readme))
             if not p.is_file() or p.read_text(encoding="utf-8") != want]
    for path, want in stale:
      have = path.read_text(encoding="utf-8").splitlines() if path.is_file() else []
      sys.stderr.writelines(line + "\n" for line in difflib.unified_diff(
          have, want.splitlines(), str(path), "generated", lineterm="", n=0))
    if stale:
      print("stale: run python -m benchmarks.report", file=sys.stderr)
    return 1 if stale else 0
  report_path.write_text(report, encoding="utf-8")
  readme_path.write_text(readme, encoding="utf-8")
  print(json.dumps({"wrote": [str(report_path), str(readme_path)]}))
  return 0


if __name__ == "__main__":
  sys.exit(main())
