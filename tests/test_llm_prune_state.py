"""A pruning run's saved state: checksummed files, refused when damaged, no temporary leftovers.

A run of a 2-block model stopped after block 0 leaves ``block_0.npz``,
``stream_1.npz`` and ``state.json``; the files are then damaged as a disk or
a killed copy would damage them. Every damage must be refused with one line
naming the folder and ``--restart``; before checksums, a changed byte in an
(uncompressed) ``.npz`` resumed silently with a changed weight.
"""

import json

import jax
import numpy as np
import pytest

from safe_optax.llm import model as model_lib
from safe_optax.llm import prune
from safe_optax.llm.prune_state import CorruptPruneState, PruneState, file_sha256

CFG = model_lib.LlamaConfig(vocab_size=40, hidden_size=16, intermediate_size=32, num_layers=2,
                            num_heads=4, num_kv_heads=2)


class _Stop(Exception):
  """Stands for Ctrl-C after block 0."""


def _stop(index, entry):
  raise _Stop


@pytest.fixture(name="stopped")
def fixture_stopped(tmp_path):
  params = model_lib.init_params(CFG, 1)
  calib = np.random.default_rng(0).integers(0, CFG.vocab_size, (4, 8))
  with pytest.raises(_Stop):
    prune.prune_model(CFG, params, calib, prune.PruneConfig("wanda"), progress=False,
                      state_dir=tmp_path / "state", on_block=_stop)
  return tmp_path / "state", params, calib


def _resume(stopped):
  state, params, calib = stopped
  return prune.prune_model(CFG, params, calib, prune.PruneConfig("wanda"), progress=False,
                           state_dir=state)


def _flip(name, fraction):
  def damage(folder):
    data = bytearray((folder / name).read_bytes())
    data[int(fraction * (len(data) - 1))] ^= 0x01
    (folder / name).write_bytes(bytes(data))
  return damage


def _truncate(name):
  return lambda folder: (folder / name).write_bytes((folder / name).read_bytes()[:100])


def _without_checksums(folder):
  """A state with no file checksums (as none of this release writes): not trusted, refused."""
  saved = json.loads((folder / "state.json").read_text())
  del saved["sha256"]
  (folder / "state.json").write_text(json.dumps(saved))


@pytest.mark.parametrize("damage, named", [
    (_flip("block_0.npz", 0.5), "block_0.npz does not match its SHA-256"),
    (_flip("block_0.npz", 0.9), "block_0.npz does not match its SHA-256"),
    (_flip("stream_1.npz", 0.7), "stream_1.npz does not match its SHA-256"),
    (_truncate("block_0.npz"), "block_0.npz does not match its SHA-256"),
    (lambda folder: (folder / "stream_1.npz").unlink(), "stream_1.npz is missing"),
    (lambda folder: (folder / "state.json").write_text('{"identity": {'),
     "state.json does not parse"),
    (lambda folder: (folder / "state.json").write_text("[]"), "state.json does not parse"),
    (_without_checksums, "state.json does not parse: 'sha256'"),
], ids=["block-50%", "block-90%", "stream", "truncated", "missing", "cut-json", "wrong-json",
        "no-checksums"])
def test_a_damaged_state_is_refused_in_one_line_naming_restart(stopped, damage, named):
  damage(stopped[0])
  with pytest.raises(CorruptPruneState) as info:
    _resume(stopped)
  message = str(info.value)
  assert message.startswith(f"the saved pruning state in '{stopped[0]}' is damaged ({named}")
  assert "--restart" in message and "\n" not in message


def test_the_state_records_each_files_sha256_and_resumes_when_intact(stopped):
  folder = stopped[0]
  saved = json.loads((folder / "state.json").read_text())
  assert saved["sha256"] == {name: file_sha256(folder / name)
                             for name in ("block_0.npz", "stream_1.npz")}
  want, _ = prune.prune_model(CFG, stopped[1], stopped[2], prune.PruneConfig("wanda"),
                              progress=False)
  got, report = _resume(stopped)
  assert report["resumed_blocks"] == 1
  jax.tree.map(np.testing.assert_array_equal, got, want)


def test_a_temporary_file_left_by_a_killed_save_is_removed_on_open(stopped):
  folder = stopped[0]
  (folder / "block_1.tmp.npz").write_bytes(b"half a file")
  (folder / "state.tmp.json").write_text("{")
  PruneState(folder, json.loads((folder / "state.json").read_text())["identity"])
  assert sorted(p.name for p in folder.iterdir()) == ["block_0.npz", "state.json",
                                                      "stream_1.npz"]
