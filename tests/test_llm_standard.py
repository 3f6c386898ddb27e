"""benchmarks/claims/llm_standard.py: which pieces a row needs, and the commands that make them."""

import argparse
import json
import pathlib
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
from benchmarks.claims import llm_standard
from safe_optax.llm import cli  # noqa: E402  pylint: disable=wrong-import-position


@pytest.fixture(autouse=True)
def _model(monkeypatch, tmp_path):
  """The pieces only name the model file: a stand-in path, so no GGUF is needed."""
  monkeypatch.setattr(llm_standard.run_results, "gguf_path", lambda: tmp_path / "model.gguf")


def _args(tmp_path, nm=None, methods=("magnitude", "sparsegpt", "safe-plus"), selection=None,
          model=None):
  return argparse.Namespace(methods=list(methods), seeds=[0, 1], nsamples=64, seqlen=512,
                            nm=None if nm is None else cli.parse_nm(nm),
                            selection=selection or tmp_path / "missing.json", work=tmp_path,
                            model=model)


@pytest.mark.parametrize("nm,structure,pattern", [(None, "50pct", ["--sparsity", "0.5"]),
                                                  ("2:4", "2of4", ["--nm", "2:4"])])
def test_each_structure_names_its_own_pieces(tmp_path, nm, structure, pattern):
  todo = llm_standard.pieces(_args(tmp_path, nm))
  names = [name for name, _, _ in todo]
  assert names == ["dense.ppl.json", f"magnitude_{structure}.prune.json",
                   f"magnitude_{structure}.ppl.json"] + [
      f"{m}_{structure}_64x512_seed{s}.{kind}.json" for m in ("sparsegpt", "safe-plus")
      for s in (0, 1) for kind in ("prune", "ppl")]
  prune = dict((name, argv) for name, argv, _ in todo)[f"sparsegpt_{structure}_64x512_seed1.prune.json"]
  i = prune.index(pattern[0])
  assert prune[i:i + 2] == pattern and "--sparsity" not in prune[i + 2:] and "--nm" not in prune[i + 2:]
  assert prune[prune.index("--seed") + 1] == "1"
  assert prune[prune.index("--out") + 1] == str(tmp_path / f"sparsegpt_{structure}_64x512_seed1")
  # SAFE+ waits for the selection's pick: no command yet, for its prune or its perplexity.
  assert all(argv is None for name, argv, _ in todo if name.startswith("safe-plus"))


def test_safe_pieces_take_lr_lambda_and_steps_from_the_selection(tmp_path):
  selection = tmp_path / "selection.json"
  selection.write_text(json.dumps({"selected": {"safe-plus": {
      "lr": 0.003, "penalty": 0.001, "steps": 1000}}}))
  todo = llm_standard.pieces(_args(tmp_path, "2:4", ["safe-plus"], selection))
  prune = dict((name, argv) for name, argv, _ in todo)["safe-plus_2of4_64x512_seed0.prune.json"]
  flag = lambda name: prune[prune.index(name) + 1]
  # 1000 steps of 64 / 8 minibatches: 125 epochs
  assert (flag("--lr"), flag("--penalty"), flag("--epochs"), flag("--batch-size")) == (
      "0.003", "0.001", "125", "8")


@pytest.mark.parametrize("nm,name", [(None, "selection_block0_64x128.json"),
                                     ("2:4", "selection_block0_64x128_2of4.json")])
def test_each_structure_reads_the_selection_made_at_it(nm, name):
  """The 2:4 pieces take their lr, lambda and steps from the study made at 2:4, not the 50 % one."""
  path = llm_standard.default_selection(None if nm is None else cli.parse_nm(nm))
  assert path.name == name and path.parent == llm_standard.run_results.HERE


def _fake_cli(calls, scores_exports=False):
  """``cli.main`` that records each command and writes what it would write; with
  ``scores_exports`` it also checks that a perplexity is scored from a prune's export."""
  def fake_main(argv):
    calls.append(argv[0])
    if argv[0] == "prune":
      folder = pathlib.Path(argv[argv.index("--out") + 1])
      folder.mkdir(parents=True)
      (folder / "report.json").write_text("{}")
    else:
      if scores_exports:
        assert pathlib.Path(argv[argv.index("--model") + 1]).is_dir()  # scored from the export
      pathlib.Path(argv[argv.index("--json") + 1]).write_text("{}")
    return 0
  return fake_main


def test_a_done_prune_whose_export_is_gone_runs_again_before_its_perplexity(tmp_path, monkeypatch):
  out, work = tmp_path / "standard", tmp_path / "work"
  out.mkdir()
  (out / "dense.ppl.json").write_text("{}")
  (out / "magnitude_50pct.prune.json").write_text("{}")  # done, but its export is not in work/
  calls = []
  monkeypatch.setattr(llm_standard, "OUT", out)
  monkeypatch.setattr(llm_standard.cli, "main", _fake_cli(calls, scores_exports=True))
  monkeypatch.setattr(sys, "argv", ["llm_standard.py", "--methods", "magnitude",
                                    "--work", str(work)])
  llm_standard.main()
  assert calls == ["prune", "ppl"] and (out / "magnitude_50pct.ppl.json").exists()
  calls.clear()
  llm_standard.main()  # everything done: nothing runs, although work/ could be cleared now
  assert calls == []


def test_a_model_path_replaces_the_installed_gguf_in_every_command(tmp_path):
  todo = llm_standard.pieces(_args(tmp_path, model=tmp_path / "copied.gguf"))
  models = [argv[argv.index("--model") + 1] for name, argv, folder in todo
            if argv is not None and folder is not None or name == "dense.ppl.json"]
  assert models and set(models) == {str(tmp_path / "copied.gguf")}


def test_no_piece_starts_past_the_deadline_and_the_next_run_resumes(tmp_path, monkeypatch):
  out, calls = tmp_path / "standard", []
  clock = iter([0.0, 10.0, 50.0, 120.0] + [0.0] * 20)  # start, then before each piece
  monkeypatch.setattr(llm_standard.time, "monotonic", lambda: next(clock))
  monkeypatch.setattr(llm_standard, "OUT", out)
  monkeypatch.setattr(llm_standard.cli, "main", _fake_cli(calls))
  argv = ["llm_standard.py", "--methods", "magnitude", "--work", str(tmp_path / "work")]
  monkeypatch.setattr(sys, "argv", argv + ["--deadline-s", "100"])
  llm_standard.main()
  # dense and magnitude's prune start at 10 s and 50 s; its perplexity would start at 120 s
  assert calls == ["ppl", "prune"] and not (out / "magnitude_50pct.ppl.json").exists()
  calls.clear()
  monkeypatch.setattr(sys, "argv", argv)
  llm_standard.main()
  assert calls == ["ppl"] and (out / "magnitude_50pct.ppl.json").exists()


def test_a_missing_model_file_is_refused_before_anything_runs(tmp_path, monkeypatch, capsys):
  monkeypatch.setattr(llm_standard.cli, "main", lambda argv: pytest.fail("ran a piece"))
  monkeypatch.setattr(sys, "argv", ["llm_standard.py", "--model", str(tmp_path / "none.gguf")])
  with pytest.raises(SystemExit):
    llm_standard.main()
  assert f"--model: no file {tmp_path / 'none.gguf'}" in capsys.readouterr().err


def test_pack_runs_a_methods_pending_seeds_as_one_command(tmp_path, monkeypatch):
  """``--pack``: one ``prune --seed ...`` for the SAFE+ seeds still pending, its ``--out``
  a ``{seed}`` pattern of the pieces' folders; each seed's report becomes its piece; the
  perplexities run one by one; a seed already done is left out of the pack."""
  out, work = tmp_path / "standard", tmp_path / "work"
  out.mkdir()
  (out / "dense.ppl.json").write_text("{}")
  (out / "safe-plus_50pct_64x512_seed1.prune.json").write_text("{}")
  (out / "safe-plus_50pct_64x512_seed1.ppl.json").write_text("{}")
  selection = tmp_path / "selection.json"
  selection.write_text(json.dumps({"selected": {"safe-plus": {
      "lr": 0.003, "penalty": 0.001, "steps": 16}}}))
  calls = []

  def fake_main(argv):
    calls.append(argv)
    if argv[0] == "prune":
      i = argv.index("--seed") + 1
      seeds = argv[i:argv.index("--out")] if "{seed}" in argv[argv.index("--out") + 1] else [
          argv[i]]
      for seed in seeds:
        folder = pathlib.Path(argv[argv.index("--out") + 1].replace("{seed}", seed))
        folder.mkdir(parents=True)
        (folder / "report.json").write_text(json.dumps({"seed": int(seed)}))
    else:
      pathlib.Path(argv[argv.index("--json") + 1]).write_text("{}")
    return 0

  monkeypatch.setattr(llm_standard, "OUT", out)
  monkeypatch.setattr(llm_standard.cli, "main", fake_main)
  monkeypatch.setattr(sys, "argv", ["llm_standard.py", "--methods", "safe-plus", "--pack",
                                    "--work", str(work), "--selection", str(selection)])
  llm_standard.main()
  assert [argv[0] for argv in calls] == ["prune", "ppl", "ppl"]
  prune = calls[0]
  assert prune[prune.index("--seed"):prune.index("--seed") + 3] == ["--seed", "0", "2"]
  assert prune[prune.index("--out") + 1] == str(work / "safe-plus_50pct_64x512_seed{seed}")
  for seed in (0, 2):
    piece = json.loads((out / f"safe-plus_50pct_64x512_seed{seed}.prune.json").read_text())
    assert piece == {"seed": seed}
    assert (out / f"safe-plus_50pct_64x512_seed{seed}.ppl.json").exists()
  # The command a pack runs parses as the CLI's own.
  args = cli.build_parser().parse_args(prune)
  assert args.seed == [0, 2] and args.method == "safe-plus"
