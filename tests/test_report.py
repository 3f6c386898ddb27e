"""benchmarks/report.py: the verdict rules at each boundary, and the committed report is what the JSON gives."""

import json
import pathlib
import shutil
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
from benchmarks import report
from benchmarks.claims import tuning
from benchmarks import report_sources
from benchmarks.report_sources import Arm, Row


def test_stat_is_the_mean_and_standard_error():
  s = report.stat([3.0, 1.0])
  assert (s.mean, s.se, s.n) == (2.0, 1.0, 2)  # sample sd sqrt(2), over sqrt(2)
  assert report.stat([4.0]).se is None


@pytest.mark.parametrize("diffs, want", [
    ([3.0, 1.0], "level"),                   # mean 2.0 = 2 s.e. exactly: within
    ([3.0, 1.01], "holds"),                  # just past 2 s.e., every seed positive
    ([-3.0, -1.01], "reversed"),
    ([-3.0, -1.0], "level"),
    ([5.0, 5.0, 5.0, 5.0, -0.1], "holds"),   # one seed against is allowed
    ([5.0, 5.0, 5.0, 5.0, 0.0], "holds"),    # a tie counts against, still one
    ([5.0, 5.0, 5.0, -0.1, -0.1], "fails"),  # two seeds against
    ([-5.0, -5.0, -5.0, 0.1, 0.1], "fails"),
    ([0.1, -0.1, 0.05], "level"),
    ([0.7], "no verdict (one seed)"),
])
def test_verdict_boundaries(diffs, want):
  assert report.verdict(diffs) == want


def test_the_two_seeds_against_case_is_past_two_standard_errors():
  s = report.stat([5.0, 5.0, 5.0, -0.1, -0.1])
  assert s.mean > report.HOLD_SE * s.se  # so "fails" comes from the seed rule alone


def _arm(name, values, short=None, distance=None, settings=None, short_settings=None):
  arm = Arm(name, dict(enumerate(values)), "2 epochs", distance=distance,
            settings=settings or {})
  if short is not None:
    arm.shorter = Arm(name, dict(enumerate(short)), "1 epoch", settings=short_settings or {})
    arm.shorter_same_hyper = arm.shorter.settings == arm.settings
  return arm


@pytest.mark.parametrize("long, short, converged", [
    ([0.5, 1.0, 0.0], [0.0, 0.0, 0.0], True),      # +0.5 at 1.7 s.e.: within both bounds
    ([0.51, 1.01, 0.01], [0.0, 0.0, 0.0], False),  # +0.51 points
    ([0.3, 0.35, 0.25], [0.0, 0.0, 0.0], False),   # +0.3 but 10 s.e.: still moving
    ([0.3, 0.7, -0.1], [0.0, 0.0, 0.0], True),     # +0.3 at 1.3 s.e.
])
def test_convergence_needs_half_a_point_and_two_standard_errors(long, short, converged):
  arms = [_arm("GMP", long, short), _arm("GMP2", [80.0, 80.0, 80.0], [80.0, 80.0, 80.0])]
  assert (report.convergence(arms, points=True) == "converged") == converged


@pytest.mark.parametrize("distance, converged", [(1.0, True), (1.01, False), (None, True)])
def test_convergence_needs_the_admm_type_iterate_on_its_sparse_set(distance, converged):
  arms = [_arm("SAFE", [90.0, 90.1], [90.0, 90.1], distance=distance)]
  assert (report.convergence(arms, points=True) == "converged") == converged


def test_convergence_is_not_shown_without_a_comparable_shorter_run():
  missing = report.convergence([_arm("ADMM", [90.0, 90.1])], points=True)
  assert missing == "not shown: ADMM: no shorter run"
  changed = report.convergence([_arm("SAFE", [90.0, 90.1], [90.0, 90.1], settings={"penalty": 0.1},
                                     short_settings={"penalty": 1.0})], points=True)
  assert "other hyperparameters" in changed


def test_a_change_is_shown_with_the_rows_digits():
  arms = [_arm("SAFE", [0.0131, 0.0132, 0.0129], [0.0141, 0.0142, 0.0140])]
  assert report.convergence(arms, points=False, digits=4) == (
      "not shown: SAFE -0.0010 ± 0.0000 vs 1 epoch")


def test_a_one_shot_method_has_no_budget_to_double():
  arms = [_arm("SAFE+", [20.0, 20.1], [20.0, 20.1]), _arm("SparseGPT", [21.0, 21.2]),
          _arm("Wanda", [22.0, 22.1])]
  assert report.convergence(arms, points=True) == "converged"
  assert report.convergence([_arm("SAFE+", [20.0, 20.1]), *arms[1:]], points=True) == (
      "not shown: SAFE+: no shorter run")


def test_a_row_that_mixes_budgets_is_refused():
  ours = _arm("SAFE", [90.0, 90.1])
  other = Arm("GMP", {0: 89.0, 1: 89.1}, "1 epoch")
  row = Row("90 %", "", ours, [other], True, True, 2)
  with pytest.raises(ValueError, match="mixes budgets"):
    report.lines(row)


def _verdict(label: str, ours, baseline) -> str:
  """The verdict of one row comparing ``ours`` with one baseline over 2 seeds."""
  line, = report.lines(Row(label, "", ours, [baseline], True, True, 2))
  return line.verdict


def test_a_win_over_a_less_tuned_baseline_is_not_a_hold():
  ours = _arm("SAFE", [91.0, 91.1, 91.2])
  ours.effort = 3
  gmp = _arm("GMP", [89.0, 89.1, 89.0])
  gmp.effort = 0
  assert _verdict("90 %", ours, gmp) == "unequal tuning (GMP not tuned)"
  gmp.effort = 3
  assert _verdict("90 %", ours, gmp) == "holds"
  gmp.unfinished = ["GMP's schedule end at the lower end of its grid"]
  assert _verdict("90 %", ours, gmp) == (
      "unequal tuning (GMP's schedule end at the lower end of its grid)")


def test_a_loss_to_a_better_tuned_baseline_is_not_reversed_but_a_loss_to_a_worse_one_is():
  ours = _arm("SAFE", [89.0, 89.1, 89.0])
  ours.effort = 2
  admm = _arm("ADMM", [91.0, 91.1, 91.2])
  admm.effort = 4
  assert _verdict("99 %", ours, admm) == "unequal tuning (SAFE's λ from 2 values, ADMM's λ from 4)"
  ours.effort, admm.effort = 4, 2  # SAFE tuned more and still behind: reversed, reason named
  assert _verdict("99 %", ours, admm) == "reversed (ADMM's λ from 2 values, SAFE's λ from 4)"


def test_lower_is_better_metrics_flip_the_sign():
  ours = _arm("SAFE", [0.01, 0.012, 0.011])
  admm = _arm("ADMM", [0.1, 0.12, 0.11])
  line, = report.lines(Row("lambda_max", "", ours, [admm], False, False, 3))
  assert line.verdict == "holds" and line.diff.mean > 0 and line.won == 3


def test_a_diverged_run_scores_chance():
  ours = _arm("SAFE", [22.0, 24.0])
  paper = Arm("paper", {0: None, 1: 12.0}, "2 epochs")
  line, = report.lines(Row("λ 1", "", ours, [paper], True, True, 2))
  assert line.diff.mean == pytest.approx(((22.0 - report.DIVERGED) + (24.0 - 12.0)) / 2)


def test_a_row_with_a_method_not_run_is_pending_and_compares_nothing():
  ours = Arm("SAFE+", {}, "64 x 512")
  wanda = Arm("Wanda", {0: 60.0, 1: 61.0}, "64 x 512")
  line, = report.lines(Row("50 %", "", ours, [wanda], False, False, 2))
  assert line.diff is None and line.verdict == "pending: SAFE+ not run yet"


@pytest.mark.slow
def test_the_committed_report_is_what_the_json_gives():
  """The CI check: ``python -m benchmarks.report --check`` on this checkout."""
  out = subprocess.run([sys.executable, "-m", "benchmarks.report", "--check"],
                       capture_output=True, text=True, check=False, cwd=ROOT)
  assert out.returncode == 0, out.stderr[-3000:]


@pytest.mark.slow
def test_check_fails_when_a_committed_number_changes(tmp_path):
  shutil.copytree(ROOT / "results", tmp_path / "results")
  shutil.copy(ROOT / "README.md", tmp_path / "README.md")
  args = [sys.executable, "-m", "benchmarks.report", "--check", "--root", str(tmp_path)]
  assert subprocess.run(args, capture_output=True, check=False, cwd=ROOT).returncode == 0
  sweep = tmp_path / "results" / "sparsity_mlp_fmnist" / "sweep_80epochs_s90.json"
  data = json.loads(sweep.read_text(encoding="utf-8"))
  data["runs"][0]["accuracy"] += 0.01
  sweep.write_text(json.dumps(data), encoding="utf-8")
  out = subprocess.run(args, capture_output=True, text=True, check=False)
  assert out.returncode == 1 and "stale" in out.stderr


def _write(path, data):
  path.write_text(json.dumps(data), encoding="utf-8")


def _declaration(safe_grid=(0.01, 0.1, 1)):
  specs = {"SAFE": {"λ": tuning.grid(*safe_grid), "ρ": tuning.PAPER_RHO},
           "GMP": {"schedule end": tuning.GMP_END, "update every": tuning.GMP_EVERY}}
  return lambda claim, row, method: specs[method]


def _folder(tmp_path, safe_grid=(0.01, 0.1, 1), chosen=0.1):
  config = {"epochs": 4, "train_subset": None, "rho": 0.1, "gmp_end_fraction": 0.75,
            "gmp_update_every": 100}
  run = lambda m, seed, acc, **kw: {"method": m, "sparsity": 0.9, "seed": seed, "accuracy": acc,
                                    "constraint_distance": 0.5 if m == "safe" else None, **kw}
  _write(tmp_path / "sweep.json", {
      "config": config,
      "runs": [run("safe", s, a, penalty=chosen, rho=0.1) for s, a in ((0, 0.91), (1, 0.92))],
      "selection": {"grid": [{"method": "safe", "sparsity": 0.9, "value": v} for v in safe_grid],
                    "chosen": {"safe@0.9": chosen}}})
  _write(tmp_path / "gmp.json", {
      "config": {**config, "gmp_end_fraction": 0.9},
      "runs": [run("gmp", s, a) for s, a in ((0, 0.90), (1, 0.905))],
      "selection": {"grid": [{"method": "gmp", "value": v} for v in (0.5, 0.75, 0.9)],
                    "chosen": {"gmp@0.9": 0.9}, "fields": {"gmp": "gmp_end_fraction"}}})
  _write(tmp_path / "claim.json", {
      "order": 1, "title": "A claim", "short": "a claim", "paper": "–", "metric": "accuracy",
      "source": "sweep", "ours": "safe", "baselines": ["gmp"],
      "rows": [{"label": "90 %", "sparsity": 0.9, "file": "sweep.json",
                "files": {"gmp": "gmp.json"}}]})
  return tmp_path


def test_a_claim_folder_is_read_with_its_provenance(tmp_path):
  """A hand-made folder: SAFE's lambda chosen inside its grid, GMP's end at its range's bound."""
  row, = report_sources.load_claim(_folder(tmp_path), _declaration()).rows
  assert row.ours.values == {0: pytest.approx(91.0), 1: pytest.approx(92.0)}
  assert "λ 0.1 ∈ {0.01, 0.1, 1} on validation" in row.ours.hyper[0]
  gmp, = row.baselines
  assert (gmp.effort, row.ours.effort) == (3, 3) and "AT GRID EDGE" in gmp.hyper[0]
  assert gmp.unfinished == []  # 0.9 is the declared upper bound: the edge rule stops there
  line, = report.lines(row)
  assert line.verdict == "holds" and line.won == 2


def test_a_grid_other_than_the_declared_one_is_refused_and_an_extension_is_accepted(tmp_path):
  with pytest.raises(ValueError, match="not the declared"):
    report_sources.load_claim(_folder(tmp_path, safe_grid=(0.03, 0.1, 1)), _declaration())
  # 0.01 picked at the declared grid's lower end, extended once below by the edge rule
  row, = report_sources.load_claim(_folder(tmp_path, (0.001, 0.01, 0.1, 1), chosen=0.01),
                                   _declaration()).rows
  assert row.ours.effort == 3 and row.ours.unfinished == []  # the declared grid's size
  row, = report_sources.load_claim(_folder(tmp_path, (0.001, 0.01, 0.1, 1), chosen=0.001),
                                   _declaration()).rows
  assert row.ours.unfinished == ["SAFE's λ at the lower end of its grid"]


def test_a_caveat_states_a_rows_verdict_from_the_rules_not_by_hand():
  ours = _arm("SAFE", [91.0, 91.1, 91.2])
  admm = _arm("ADMM", [89.0, 89.1, 89.0])
  lines = report.lines(Row("75 %", "", ours, [admm], True, True, 2))
  assert (report.with_verdicts("It shows {verdict: 75 %}.", lines)
          == "It shows against ADMM **holds**.")
  with pytest.raises(ValueError, match="'50 %'"):
    report.with_verdicts("{verdict:50 %}", lines)


def _robustness_file(path, ran=0.1, chosen=0.1, epochs=20, clean=(0.95, 0.96), lr=0.1,
                     distance=None, chosen_at=None):
  def ev(method, seed, acc):
    return {"config": {"seed": seed, "epochs": epochs, "sparsity": 0.9, "rho": 0.1,
                       "rescale_dual": method == "safe", "penalty": ran if method == "safe" else None,
                       "admm_penalty": 0.01, "penalty_table": [[1.0, 0.1]], "learning_rate": lr},
            "clean": acc, "corruptions": {"mean": {"3": 0.8, "5": 0.7}},
            "pgd-linf": {"adversarial": 0.5}, "pgd-l2": {"adversarial": 0.6},
            "hessian": {"lambda_max_support": 1.0}, "constraint_distance": distance}
  grid = ([{"method": "safe", "value": v} for v in (0.01, 0.1, 1)]
          + [{"method": "admm", "value": v} for v in (0.001, 0.01, 0.1)])
  selection = {"grid": grid, "chosen": {"safe@0.9": chosen, "admm@0.9": 0.01}}
  if chosen_at is not None:  # robustness_mnist.py --chosen-from
    selection.update(epochs=chosen_at, file="results/r/rob20.json")
  _write(path, {"sparsity": 0.9, "selection": selection,
                "evals": {"safe": [ev("safe", s, c) for s, c in enumerate(clean)],
                          "admm": [ev("admm", s, c - 0.01) for s, c in enumerate(clean)]}})


def _one_row_claim(tmp_path, source, file, row, shorter, specs):
  """A claim folder of one SAFE-against-ADMM row; returns it and the declared tuning ``specs``
  (``{method name: {hyperparameter: grid}}``) as :func:`report_sources.load_claim` takes it."""
  if shorter is not None:
    row = {**row, "shorter": shorter}
  _write(tmp_path / "claim.json", {
      "order": 1, "title": source, "short": source, "paper": "–", "metric": "accuracy",
      "source": source, "file": file, "ours": "safe", "baselines": ["admm"], "rows": [row]})
  return tmp_path, lambda claim, row, method: specs[method]


def _robustness_folder(tmp_path, ran=0.1, chosen=0.1, shorter=None):
  _robustness_file(tmp_path / "rob.json", ran, chosen)
  return _one_row_claim(tmp_path, "robustness", "rob.json", {"label": "clean", "metric": "clean"},
                        shorter, {"SAFE": {"λ": tuning.grid(0.01, 0.1, 1), "ρ": tuning.PAPER_RHO},
                                  "ADMM": {"λ": tuning.grid(0.001, 0.01, 0.1)}})


def test_a_robustness_row_reads_each_lambda_from_its_selection(tmp_path):
  row, = report_sources.load_claim(*_robustness_folder(tmp_path)).rows
  assert row.ours.hyper[:3] == ["λ 0.1 ∈ {0.01, 0.1, 1} on validation (`rob.json`)",
                                "ρ 0.1 (the paper's value, not tuned)", "`rescale_dual`"]
  assert "unchosen" not in row.ours.flags and (row.ours.effort, row.baselines[0].effort) == (3, 3)
  assert row.ours.values == {0: pytest.approx(95.0), 1: pytest.approx(96.0)}
  with pytest.raises(ValueError, match="safe ran with lambda 1, selection chose 0.1"):
    report_sources.load_claim(*_robustness_folder(tmp_path, ran=1.0))


@pytest.mark.parametrize("shorter, want", [
    ({"clean": (0.948, 0.961)}, "converged"),
    ({"clean": (0.94, 0.95)}, "not shown: SAFE +1.00 ± 0.00 vs 10 epochs; ADMM +1.00 ± 0.00 vs 10 epochs"),
    ({"clean": (0.948, 0.961), "lr": 0.05},
     "not shown: SAFE: shorter run used other hyperparameters; "
     "ADMM: shorter run used other hyperparameters"),
    ({"clean": (0.948, 0.961), "ran": 1.0, "chosen": 1.0},
     "not shown: SAFE: shorter run used other hyperparameters"),
])
def test_a_robustness_row_is_converged_only_against_the_same_settings_at_a_shorter_budget(
    tmp_path, shorter, want):
  folder, declared = _robustness_folder(tmp_path, shorter="rob10.json")
  _robustness_file(folder / "rob10.json", epochs=10, **shorter)
  row, = report_sources.load_claim(folder, declared).rows
  assert report.convergence([row.ours, *row.baselines], row.points) == want


def test_a_robustness_row_checks_the_iterate_and_names_the_budget_its_lambda_was_chosen_at(
    tmp_path):
  folder, declared = _robustness_folder(tmp_path, shorter="rob10.json")
  _robustness_file(folder / "rob.json", distance=1.5, chosen_at=10)
  _robustness_file(folder / "rob10.json", epochs=10, distance=3.0)
  row, = report_sources.load_claim(folder, declared).rows
  assert row.ours.hyper[0] == "λ 0.1 ∈ {0.01, 0.1, 1} on validation (`rob20.json`, chosen at 10 epochs)"
  assert report.convergence([row.ours, *row.baselines], row.points) == (
      "not shown: SAFE ||x − z|| 1.50; ADMM ||x − z|| 1.50")


def _noise_file(path, epochs=50, acc=(0.93, 0.94), rho=0.05, warmup=2, distance=0.5,
                chosen_at=None):
  """A label_noise.py output at noise 0.5: SAFE (λ 3, ρ chosen) and ADMM (λ 0.3), two seeds."""
  runs = [{"method": m, "noise": 0.5, "seed": seed, "penalty": lam,
           "accuracy": a - (0.01 if m == "admm" else 0.0), "constraint_distance": distance,
           **({"rho": rho, "rescale_dual": True} if m == "safe" else {"rho": 0.1})}
          for m, lam in (("safe", 3.0), ("admm", 0.3)) for seed, a in enumerate(acc)]
  grid = ([{"method": "safe", "value": v} for v in (1.0, 3.0, 10.0)]
          + [{"method": "admm", "value": v} for v in (0.1, 0.3, 1.0)])
  selection = {"grid": grid, "chosen": {"safe@0.9": 3.0, "admm@0.9": 0.3},
               "chosen_rho": {"safe@0.9": 0.05}, "rho_grid": [0.02, 0.05, 0.1]}
  if chosen_at is not None:  # label_noise.py --chosen-from
    selection.update(epochs=chosen_at, file="results/label_noise/ln25.json")
  _write(path, {"config": {"epochs": epochs, "seed": 0, "warmup_epochs": warmup, "rho": 0.1,
                           "test_only_split": [8000, 2000]},
                "selection": {"0.5": selection}, "runs": runs})


def _noise_folder(tmp_path, shorter=None):
  return _one_row_claim(tmp_path, "label_noise", "ln.json", {"label": "50 %", "noise": 0.5},
                        shorter, {"SAFE": {"λ": tuning.grid(1, 3, 10),
                                           "ρ": tuning.grid(0.02, 0.05, 0.1)},
                                  "ADMM": {"λ": tuning.grid(0.1, 0.3, 1)}})


@pytest.mark.parametrize("shorter, want", [
    ({"acc": (0.931, 0.938)}, "converged"),
    ({"acc": (0.92, 0.93)},
     "not shown: SAFE +1.00 ± 0.00 vs 25 epochs on 8000 images; "
     "ADMM +1.00 ± 0.00 vs 25 epochs on 8000 images"),
    ({"acc": (0.931, 0.938), "rho": 0.1},
     "not shown: SAFE: shorter run used other hyperparameters"),
    ({"acc": (0.931, 0.938), "warmup": 1},
     "not shown: SAFE: shorter run used other hyperparameters; "
     "ADMM: shorter run used other hyperparameters"),
    ({"acc": (0.931, 0.938), "distance": 2.0}, "converged"),  # the longer run's iterate counts
])
def test_a_label_noise_row_is_converged_only_against_its_settings_at_a_shorter_budget(
    tmp_path, shorter, want):
  folder, declared = _noise_folder(tmp_path, shorter="ln25.json")
  _noise_file(folder / "ln.json")
  _noise_file(folder / "ln25.json", epochs=25, chosen_at=50, **shorter)
  row, = report_sources.load_claim(folder, declared).rows
  assert row.ours.hyper == ["λ 3 ∈ {1, 3, 10} on validation (`ln.json`)",
                            "ρ 0.05 ∈ {0.02, 0.05, 0.1} on validation (`ln.json`)",
                            "`rescale_dual`"]
  assert report.convergence([row.ours, *row.baselines], row.points) == want


def test_a_label_noise_row_names_the_budget_its_values_were_chosen_at(tmp_path):
  folder, declared = _noise_folder(tmp_path)
  _noise_file(folder / "ln.json", epochs=100, distance=1.5, chosen_at=50)
  row, = report_sources.load_claim(folder, declared).rows
  assert row.ours.hyper[:2] == [
      "λ 3 ∈ {1, 3, 10} on validation (`ln25.json`, chosen at 50 epochs)",
      "ρ 0.05 ∈ {0.02, 0.05, 0.1} on validation (`ln25.json`, chosen at 50 epochs)"]
  assert report.convergence([row.ours, *row.baselines], row.points) == (
      "not shown: SAFE: no shorter run; ADMM: no shorter run; SAFE ||x − z|| 1.50; "
      "ADMM ||x − z|| 1.50")


def test_a_config_field_added_after_a_run_is_read_at_the_default_that_run_had():
  from safe_optax.vision import configs  # pylint: disable=import-outside-toplevel
  defaults = configs.Config()
  assert {k: getattr(defaults, k) for k in report_sources.ADDED_FIELDS} == report_sources.ADDED_FIELDS


def test_a_row_repeated_at_a_shorter_budget_is_counted_once_in_the_summary(tmp_path):
  _flatness_file(tmp_path / "flat.json", 100, (0.96, 0.97))
  _flatness_file(tmp_path / "flat50.json", 50, (0.961, 0.968))
  specs = {"SAFE": {"λ": tuning.grid(0.001, 0.01, 0.1), "ρ": tuning.PAPER_RHO},
           "ADMM": {"λ": tuning.grid(0.001, 0.01, 0.1)}}
  rows = [{"label": "accuracy", "metric": "test_accuracy", "higher_is_better": True},
          {"label": "accuracy, 50 epochs", "metric": "test_accuracy", "higher_is_better": True,
           "file": "flat50.json", "selection": "flat.json", "budget_check": "accuracy"}]
  claim = {"order": 1, "title": "Flatness", "short": "f", "paper": "–", "metric": "m",
           "source": "flatness", "file": "flat.json", "ours": "safe", "baselines": ["admm"],
           "rows": rows}
  _write(tmp_path / "claim.json", claim)
  loaded = report_sources.load_claim(tmp_path, lambda c, r, m: specs[m])
  all_lines = [line for row in loaded.rows for line in report.lines(row)]
  assert len(all_lines) == 2
  line = report.summary_line(loaded, all_lines)
  assert line.endswith(": vs ADMM: level 1 (rows converged: 0 of 1; 1 at shorter budgets "
                       "not counted)")
  for target in ("accuracy, 100 epochs", "accuracy, 50 epochs"):  # unknown; the row itself
    rows[1]["budget_check"] = target
    _write(tmp_path / "claim.json", claim)
    with pytest.raises(ValueError, match="must be another row of the claim at another budget"):
      report_sources.load_claim(tmp_path, lambda c, r, m: specs[m])


def _flatness_file(path, epochs, accuracy, penalty=0.01, lam=0.1):
  runs = lambda method: [{"seed": s, "test_accuracy": a, "lambda_max": lam + s,
                          "constraint_distance": None if method == "dense" else 0.5}
                         for s, a in enumerate(accuracy)]
  _write(path, {
      "config": {"dataset": "mnist", "split_seed": 0, "sparsity": 0.9, "epochs": epochs,
                 "batch_size": 128, "learning_rate": 0.1, "warmup_epochs": 2, "momentum": 0.9,
                 "weight_decay": 1e-4, "dual_every": 32, "rho": 0.1, "safe_penalty": penalty,
                 "admm_penalty": 0.01},
      "data": {"train": 8000},
      "selection": {"grid": {"safe": [{"penalty": p} for p in (0.001, 0.01, 0.1)],
                             "admm": [{"penalty": p} for p in (0.001, 0.01, 0.1)]},
                    "chosen": {"safe": penalty, "admm": 0.01}},
      "runs": {"safe": runs("safe"), "admm": runs("admm")}})


@pytest.mark.parametrize("shorter, accuracy_row, lambda_row", [
    ({}, "converged", "not shown: not an accuracy: no budget rule"),
    ({"penalty": 0.1}, "not shown: SAFE: shorter run used other hyperparameters",
     "not shown: SAFE: shorter run used other hyperparameters"),
])
def test_a_flatness_claim_reads_its_shorter_budget_with_the_same_settings(
    tmp_path, shorter, accuracy_row, lambda_row):
  _flatness_file(tmp_path / "flat.json", 100, (0.96, 0.97))
  _flatness_file(tmp_path / "flat50.json", 50, (0.961, 0.968), **shorter)
  _write(tmp_path / "claim.json", {
      "order": 1, "title": "Flatness", "short": "f", "paper": "–", "metric": "m",
      "source": "flatness", "file": "flat.json", "shorter": "flat50.json", "ours": "safe",
      "baselines": ["admm"],
      "rows": [{"label": "accuracy", "metric": "test_accuracy", "higher_is_better": True},
               {"label": "lambda_max", "metric": "lambda_max", "higher_is_better": False}]})
  specs = {"SAFE": {"λ": tuning.grid(0.001, 0.01, 0.1), "ρ": tuning.PAPER_RHO},
           "ADMM": {"λ": tuning.grid(0.001, 0.01, 0.1)}}
  accuracy, lam = report_sources.load_claim(tmp_path, lambda c, r, m: specs[m]).rows
  assert accuracy.ours.budget == "100 epochs on 8000 images"
  assert accuracy.ours.shorter.budget == "50 epochs on 8000 images"
  assert report.convergence([accuracy.ours, *accuracy.baselines], accuracy.points) == accuracy_row
  assert report.convergence([lam.ours, *lam.baselines], lam.points) == lambda_row


def test_a_flatness_row_at_another_budget_takes_lambda_from_the_selection_it_names(tmp_path):
  _flatness_file(tmp_path / "flat.json", 100, (0.96, 0.97))
  specs = {"SAFE": {"λ": tuning.grid(0.001, 0.01, 0.1), "ρ": tuning.PAPER_RHO},
           "ADMM": {"λ": tuning.grid(0.001, 0.01, 0.1)}}
  for penalty in (0.01, 0.1):
    _flatness_file(tmp_path / "flat50.json", 50, (0.961, 0.968), penalty=penalty)
    _write(tmp_path / "claim.json", {
        "order": 1, "title": "Flatness", "short": "f", "paper": "–", "metric": "m",
        "source": "flatness", "file": "flat50.json", "selection": "flat.json", "ours": "safe",
        "baselines": ["admm"],
        "rows": [{"label": "accuracy", "metric": "test_accuracy", "higher_is_better": True}]})
    if penalty == 0.1:
      with pytest.raises(ValueError, match="safe ran with lambda 0.1, its selection chose 0.01"):
        report_sources.load_claim(tmp_path, lambda c, r, m: specs[m])
    else:
      row, = report_sources.load_claim(tmp_path, lambda c, r, m: specs[m]).rows
      assert row.ours.hyper[0] == ("λ 0.01 ∈ {0.001, 0.01, 0.1} on validation "
                                   "(`flat.json`, chosen at 100 epochs)")


def _block_folder(tmp_path, ran_penalty):
  def run(lr, penalty, err):
    return {"method": "safe-plus", "structure": "50%", "n": 16, "lr_scale": "none", "steps": 60,
            "lr": lr, "penalty": penalty, "held_out_error": err}
  tried = ((0.001, 0.001, 0.04), (0.003, 0.0001, 0.027), (0.003, 0.001, 0.029),
           (0.003, 0.01, 0.030), (0.01, 0.001, 0.05))
  _write(tmp_path / "block_selection_block0.json", {"runs": {
      f"k{i}": run(*t) for i, t in enumerate(tried)}})
  _write(tmp_path / "block.json", {
      "steps": 60, "windows": 16, "seqlen": 128, "learning_rate": 0.003, "penalty": ran_penalty,
      "seeds": {"0": {"safe-plus": 0.028, "wanda": 0.046}, "1": {"safe-plus": 0.027,
                                                                  "wanda": 0.047}}})
  _write(tmp_path / "claim.json", {
      "order": 1, "title": "LLM", "short": "l", "paper": "–", "metric": "error",
      "source": "llm_block", "file": "block.json", "ours": "safe-plus", "baselines": ["wanda"],
      "rows": [{"label": "block 0"}]})
  specs = {"SAFE+": {"lr": tuning.grid(0.001, 0.003, 0.01), "λ": tuning.grid(0.001, 0.01)},
           "Wanda": {}}
  return tmp_path, lambda claim, row, method: specs[method]


def test_a_block_study_setting_that_an_extension_beat_is_flagged_not_chosen(tmp_path):
  """The edge rule's λ 0.0001 has the lowest held-out error: runs at 0.001 are not the pick."""
  row, = report_sources.load_claim(*_block_folder(tmp_path, ran_penalty=0.001)).rows
  assert "unchosen" in row.ours.flags
  assert "NOT THE PICK: the study's best is lr 0.003, λ 0.0001" in row.ours.hyper
  row, = report_sources.load_claim(*_block_folder(tmp_path, ran_penalty=0.0001)).rows
  assert "unchosen" not in row.ours.flags and row.ours.unfinished == [
      "SAFE+'s λ at the lower end of its grid"]


def _standard_folder(tmp_path, steps=120, steps_grid=(60, 120, 250), bound=None, upper=None,
                     chosen_at=None):
  """llm_standard.py's pieces at 2:4: magnitude once, SparseGPT at seeds 0 and 1, SAFE+ at seed 0.

  ``bound``: the selection's recorded steps bound; ``upper``: the declared one; ``chosen_at``:
  the structure the selection study recorded (none: an unstructured study's file).
  """
  files = tmp_path / "standard"
  files.mkdir(parents=True)

  def ppl(name, value):
    _write(files / f"{name}.ppl.json", {"perplexity": value, "tokens": 1000, "window": 100})

  ppl("magnitude_2of4", 900.0)
  ppl("sparsegpt_2of4_64x512_seed0", 40.0)
  ppl("sparsegpt_2of4_64x512_seed1", 42.0)
  ppl("safe-plus_2of4_64x512_seed0", 38.0)
  _write(files / "safe-plus_2of4_64x512_seed0.prune.json", {
      "prune_config": {"learning_rate": 0.003, "penalty": 0.001, "epochs": steps // 8,
                       "batch_size": 8},
      "calibration": {"nsamples": 64}})
  bounds = {} if bound is None else {"steps_bound": bound, "steps_bound_why": "a budget"}
  _write(tmp_path / "sel.json", {"selected": {"safe-plus": {
      "lr": 0.003, "lr_grid": [0.001, 0.003, 0.01], "penalty": 0.001,
      "penalty_grid": [0.0001, 0.001, 0.01], "steps": steps, "steps_grid": list(steps_grid),
      **bounds}}, **({} if chosen_at is None else {"structure": chosen_at})})
  row = {"source": "llm_standard", "dir": "standard", "calibration": "64x512", "seeds": [0, 1],
         "selection": "sel.json"}
  _write(tmp_path / "claim.json", {
      "order": 1, "title": "LLM", "short": "l", "paper": "–", "metric": "perplexity",
      "source": "llm", "ours": "safe-plus", "baselines": ["sparsegpt", "magnitude"],
      "higher_is_better": False,
      "rows": [{**row, "label": "2:4", "structure": "2of4"}, {**row, "label": "50 %"}]})
  specs = {"SAFE+": {"lr": tuning.grid(0.001, 0.003, 0.01), "λ": tuning.grid(0.0001, 0.001, 0.01),
                     "steps": tuning.grid(60, 120, 250, upper=upper)},
           "SparseGPT": {}, "magnitude": {}}
  return tmp_path, lambda claim, row, method: specs[method]


def test_a_standard_protocol_row_reads_its_structures_pieces_per_seed(tmp_path):
  """The 2:4 row reads the 2of4 pieces only; magnitude's one run stands in every seed; SAFE+ at
  2:4 reuses the 50 % study's picks, so it is flagged NOT CHOSEN; the 50 % row is still pending."""
  nm, half = report_sources.load_claim(*_standard_folder(tmp_path)).rows
  sparsegpt, magnitude = nm.baselines
  assert nm.ours.values == {0: 38.0}
  assert sparsegpt.values == {0: 40.0, 1: 42.0} and magnitude.values == {0: 900.0, 1: 900.0}
  assert "unchosen" in nm.ours.flags and "unchosen" not in sparsegpt.flags
  assert "NOT CHOSEN for 2:4 (the 50 % study's picks)" in nm.ours.hyper
  assert "120 steps per block" in nm.ours.hyper  # 15 epochs of 64 / 8 batches
  assert "1000 tokens in 100-token windows" in nm.ours.budget
  assert all(not arm.values for arm in (half.ours, *half.baselines))
  assert half.ours.hyper == ["not run yet"]


def test_a_2of4_row_whose_study_was_made_at_2of4_is_chosen(tmp_path):
  """``llm_block_studies.py select --nm 2:4`` records ``structure: 2of4``: its picks are the 2:4
  row's own, so no NOT CHOSEN flag; the same file read by a 50 % row would be flagged."""
  nm, _ = report_sources.load_claim(*_standard_folder(tmp_path, chosen_at="2of4")).rows
  assert "unchosen" not in nm.ours.flags
  assert not any("NOT CHOSEN" in h for h in nm.ours.hyper)
  assert "120 steps per block" in nm.ours.hyper


def test_a_steps_pick_at_the_declared_bound_is_settled_and_without_it_is_unfinished(tmp_path):
  """The step grid's two extensions ended at 1000 with the pick at the top; the bound 1920 is
  tried once more (llm_block_studies.edge_rule_pick) and is not counted as an extension."""
  extended = (60, 120, 250, 500, 1000, 1920)
  nm, _ = report_sources.load_claim(*_standard_folder(
      tmp_path / "a", 1920, extended, bound=1920, upper=1920)).rows
  assert nm.ours.unfinished == []
  assert any("steps 1920" in h and "at the range's bound (a budget)" in h
             and "AT GRID EDGE" not in h for h in nm.ours.hyper)
  # The bound can also move the pick back inside: 1000 after 1920 was tried.
  nm, _ = report_sources.load_claim(*_standard_folder(
      tmp_path / "b", 1000, extended, bound=1920, upper=1920)).rows
  assert nm.ours.unfinished == [] and not any("AT GRID EDGE" in h for h in nm.ours.hyper)
  # Without a declared bound, the third value above the grid is one extension too many.
  with pytest.raises(ValueError, match="not the declared"):
    report_sources.load_claim(*_standard_folder(tmp_path / "c", 1920, extended, bound=1920))
  # Two extensions and no bound tried: the top pick is tuning left unfinished.
  nm, _ = report_sources.load_claim(*_standard_folder(
      tmp_path / "d", 1000, extended[:-1], upper=1920)).rows
  assert nm.ours.unfinished == ["SAFE+'s steps at the upper end of its grid"]
