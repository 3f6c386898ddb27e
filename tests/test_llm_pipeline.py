"""safe_optax.llm.pipeline: the typed run that ``safe-optax-llm prune`` parses its flags into.

The library function and the command are one path: the same run through
either writes the same bits, and each finds the other's export finished.
"""

import dataclasses
import json

import numpy as np
import pytest
from safetensors.numpy import load_file

from safe_optax.llm import cli
from safe_optax.llm import pipeline
from safe_optax.llm.prune_config import PruneConfig
from test_llm_cli import fixture_tiny  # noqa: F401  pylint: disable=unused-import

SAFE = PruneConfig("safe-plus", epochs=2, batch_size=2, learning_rate=3e-3, dual_every=2)


def _run(tiny, out, **fields) -> pipeline.PruneRun:
  folder, text = tiny
  return pipeline.PruneRun(model=str(folder), calib=str(text), out=str(out), prune=SAFE,
                           nsamples=4, seqlen=16, progress=False, **fields)


@pytest.mark.parametrize("fields, named", [
    (dict(seeds=(0, 0)), "`seeds` must be distinct"),
    (dict(seeds=()), "`seeds` must be distinct and at least one"),
    (dict(seeds=(0, 1)), "put '{seed}' in `out`"),
    (dict(seeds=(0, 1), out="o_{seed}", fixed_order=True), "`fixed_order` prunes one seed"),
    (dict(nsamples=0), "`nsamples` must be an int >= 1"),
    (dict(seqlen=1), "`seqlen` must be an int >= 2"),
    (dict(dtype="int8"), "`dtype` must be one of"),
    (dict(export_dtype="float64"), "`export_dtype` must be one of"),
])
def test_a_run_that_cannot_work_is_refused_at_construction_naming_the_field(fields, named):
  with pytest.raises(ValueError, match=named.replace("{", r"\{").replace("}", r"\}")):
    pipeline.PruneRun(**{"model": "m", "calib": "c", "out": "o", "prune": SAFE, **fields})


@pytest.mark.parametrize("fields, named", [
    (dict(protocol="long"), "`protocol` must be one of"),
    (dict(max_tokens=64), "`max_tokens` applies only to the short protocol"),
    (dict(protocol="short", seqlen=1), "`seqlen` must be an int >= 2"),
    (dict(protocol="short", seqlen=64, max_tokens=32), "fewer than `seqlen` 64"),
])
def test_an_evaluation_that_cannot_work_is_refused_naming_the_field(fields, named):
  with pytest.raises(ValueError, match=named):
    pipeline.Evaluation(**fields)


def test_each_seed_is_a_lane_with_its_folder_and_its_seed():
  run = pipeline.PruneRun("m", "c", "out_{seed}", SAFE, seeds=(3, 5))
  lanes = run.lanes()
  assert [(lane.out, lane.seeds, lane.prune.seed) for lane in lanes] == [
      ("out_3", (3,), 3), ("out_5", (5,), 5)]
  assert lanes[0].prune == dataclasses.replace(SAFE, seed=3)
  assert [str(d) for d in run.state_dirs()] == ["out_3/prune_state", "out_5/prune_state"]
  assert pipeline.PruneRun("m", "c", "o", dataclasses.replace(SAFE, seed=7)).seeds == (7,)


def test_the_library_and_the_command_write_the_same_export(tiny, tmp_path, capsys):
  """prune_and_export and `safe-optax-llm prune` with the same settings: the same tensors and
  per-block errors; and the command finds the library's export finished (one identity)."""
  folder, text = tiny
  report, = pipeline.prune_and_export(_run(tiny, tmp_path / "lib"))
  assert cli.main(["prune", "--model", str(folder), "--calib", str(text), "--nsamples", "4",
                   "--seqlen", "16", "--method", "safe-plus", "--epochs", "2",
                   "--batch-size", "2", "--lr", "3e-3", "--dual-every", "2",
                   "--out", str(tmp_path / "cli"), "--no-progress"]) == 0
  want, got = (load_file(str(tmp_path / name / "model.safetensors")) for name in ("cli", "lib"))
  assert want.keys() == got.keys()
  for name in want:
    np.testing.assert_array_equal(got[name], want[name], err_msg=name)
  cli_report = json.loads((tmp_path / "cli" / "report.json").read_text())
  assert [b["relative_error"] for b in report["blocks"]] == [
      b["relative_error"] for b in cli_report["blocks"]]
  assert {**report["args"], "out": None} == {**cli_report["args"], "out": None}
  assert report["sparsity"]["prunable"] == pytest.approx(0.5)
  assert not (tmp_path / "lib" / pipeline.STATE_DIR).exists()
  capsys.readouterr()
  # The command, on the library's folder: already finished, nothing pruned.
  assert cli.main(["prune", "--model", str(folder), "--calib", str(text), "--nsamples", "4",
                   "--seqlen", "16", "--method", "safe-plus", "--epochs", "2",
                   "--batch-size", "2", "--lr", "3e-3", "--dual-every", "2",
                   "--out", str(tmp_path / "lib"), "--no-progress"]) == 0
  assert json.loads(capsys.readouterr().out)["seconds_total"] == report["seconds_total"]
  # The library, with another setting, on the command's folder: refused, naming it.
  other = dataclasses.replace(SAFE, epochs=3)
  with pytest.raises(ValueError, match="--epochs: saved 2, now 3"):
    pipeline.prune_and_export(dataclasses.replace(_run(tiny, tmp_path / "cli"), prune=other))
