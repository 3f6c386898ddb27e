"""A vision run's files for other tools: Orbax checkpoints plain Orbax reads, the safetensors export.

* A checkpoint of the trainer is restored by docs/checkpoints.md's recipe in
  a subprocess that cannot import safe_optax (an import hook refuses it),
  with Orbax, JAX and NumPy only; its ``params``, ``batch_stats``, ``step``,
  ``rng`` and ``opt_state`` equal the trainer's final state. The recipe also
  reads, on one device, a checkpoint written with two.
* The finished run's ``sparse_params`` / ``masks`` / ``batch_stats``
  safetensors, read with ``safetensors.numpy.load_file``, equal the deployed
  model; the masks are its nonzeros and their sparsity is the requested one.
* A run in a relative workdir resumes from another current directory.
* A checkpoint of the unreleased formats before 0.1.0 (the state's leaves as
  one unnamed list; a layout naming another version) is refused naming ``--restart``.
* A damaged checkpoint (a changed byte in a data file, a truncated data file,
  garbage in ``_METADATA`` or the layout) is refused at restore with one line
  naming it and ``--restart``; the trainer does not resume from it, and
  ``restart=True`` trains from the start to the uninterrupted result.

Cost: the trainer runs a tiny MLP with BatchNorm (the project's models with
BatchNorm are convolutional, and compile for minutes on a busy 2-core CPU)
and the MLP of tests/test_train.py on 100 generated 8x8 images.
"""

from __future__ import annotations

import json
import os
import pathlib
import re
import subprocess
import sys
import textwrap
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from safetensors import safe_open
from safetensors.numpy import load_file

import safe_optax
from safe_optax.vision import checkpoint as checkpoint_lib
from safe_optax.vision import programs as programs_lib
from safe_optax.vision import train

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import process_launcher  # noqa: E402  (forced-device XLA flags)
import test_train  # noqa: E402  (the tiny data set and config of the trainer tests)


class BatchNormMLP(nn.Module):
  """Dense - BatchNorm - ReLU - Dense: a model with a ``batch_stats`` collection."""

  num_classes: int

  @nn.compact
  def __call__(self, x, train: bool = False):
    x = nn.Dense(12)(x.reshape((x.shape[0], -1)))
    x = nn.relu(nn.BatchNorm(use_running_average=not train, momentum=0.9)(x))
    return nn.Dense(self.num_classes)(x)


# mlp_features=(12,) keeps this configuration's cached programs apart from test_train's.
BN_CONFIG = dict(mlp_features=(12,), epochs=2, warmup_epochs=0, sparsity=0.75, bnt_samples=48)


@pytest.fixture(scope="module")
def bn_run(tmp_path_factory):
  """A finished SAFE run of :class:`BatchNormMLP` in ``runs/my-run`` (the docs' path) under
  ``base``: ``(outcome, base)``."""
  base = tmp_path_factory.mktemp("bn")
  workdir = base / "runs" / "my-run"
  with pytest.MonkeyPatch.context() as patch:
    patch.setattr(programs_lib, "create_model", lambda config, n: BatchNormMLP(n))
    out = train.train_and_evaluate(test_train.tiny_config(**BN_CONFIG), workdir,
                                   data_dir=None, dataset=test_train.tiny_dataset())
  assert list(out.state.model_state) == ["batch_stats"]
  return out, base


def _docs_python_blocks() -> list[str]:
  """The ```python blocks of docs/checkpoints.md, in order (the recipes this file runs)."""
  text = (pathlib.Path(__file__).resolve().parents[1] / "docs" / "checkpoints.md").read_text()
  return re.findall(r"```python\n(.*?)```", text, flags=re.S)


_NO_SAFE_OPTAX = textwrap.dedent("""
    import importlib.abc, sys

    class NoSafeOptax(importlib.abc.MetaPathFinder):
      def find_spec(self, name, path, target=None):
        if name.split(".")[0] == "safe_optax":
          raise ImportError("this reader must not need safe_optax")

    sys.meta_path.insert(0, NoSafeOptax())
""")

_SAVE_RESTORED = textwrap.dedent("""
    import jax
    flat = {"step": step, "rng": rng}
    for item, tree in (("params", params), ("batch_stats", batch_stats),
                       ("opt_state", opt_state)):
      for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        assert all(isinstance(p, jax.tree_util.DictKey) for p in path)  # plain nested dicts
        flat[item + "/" + "/".join(p.key for p in path)] = np.asarray(leaf)
    assert not [m for m in sys.modules if m.split(".")[0] == "safe_optax"]
    np.savez("restored.npz", **flat)
""")



def _flat(tree, prefix: str) -> dict[str, np.ndarray]:
  return {prefix + "/" + "/".join(str(getattr(p, "key", p)) for p in path): np.asarray(leaf)
          for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]}


def _restore_with_the_docs_recipe(*bases: pathlib.Path) -> list[dict[str, np.ndarray]]:
  """Runs docs/checkpoints.md's Orbax recipe on ``base/runs/my-run`` of each of ``bases`` (from
  ``base`` as the current directory, one after the other) in one one-device process that cannot
  import safe_optax; returns what it restored from each, flattened."""
  recipe = _docs_python_blocks()[0] + _SAVE_RESTORED
  script = _NO_SAFE_OPTAX + textwrap.dedent(f"""
      import os
      for base in sys.argv[1:]:
        os.chdir(base)
        exec({recipe!r}, {{"__name__": "__main__", "sys": sys}})
  """)
  env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": ""}
  proc = subprocess.run([sys.executable, "-c", script, *map(str, bases)], capture_output=True,
                        text=True, env=env, timeout=300, check=False)
  assert proc.returncode == 0, proc.stderr[-4000:]
  return [dict(np.load(base / "restored.npz")) for base in bases]


def _assert_restored(restored: dict[str, np.ndarray], state: dict[str, Any]) -> None:
  want = {**_flat(state["params"], "params"),
          **_flat(state["model_state"]["batch_stats"], "batch_stats"),
          # opt_state: a nested dict keyed by the optax state's path (checkpoint.encode).
          **_flat(checkpoint_lib.encode(state["opt_state"]), "opt_state"),
          "step": np.asarray(state["step"]), "rng": np.asarray(state["rng"])}
  assert sorted(restored) == sorted(want)
  assert any(name.startswith("opt_state/") for name in want)
  for name, value in want.items():
    np.testing.assert_array_equal(restored[name], value, err_msg=name)
    assert restored[name].dtype == value.dtype, name


_TWO_DEVICE_SAVE = textwrap.dedent("""
    import sys
    import jax, jax.numpy as jnp, numpy as np, optax
    import safe_optax
    from safe_optax.vision import checkpoint

    mesh = jax.sharding.Mesh(np.array(jax.devices()), ("data",))
    replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    params = {"Dense_0": {"kernel": jnp.arange(12.0).reshape(3, 4), "bias": jnp.ones(4)}}
    tx = safe_optax.safe(0.1, 0.5, penalty=1e-2, total_steps=10)
    state = jax.device_put({
        "step": jnp.int32(5), "rng": jax.random.PRNGKey(3), "params": params,
        "model_state": {"batch_stats": {"BatchNorm_0": {"mean": jnp.full(4, 0.5),
                                                        "var": jnp.full(4, 2.0)}}},
        "opt_state": tx.init(params)}, replicated)
    assert jax.device_count() == 2
    checkpoint.Checkpointer(sys.argv[1]).save(5, state)
    np.savez(sys.argv[2], **{"/".join(str(getattr(p, "key", p)) for p in path): np.asarray(x)
                             for path, x in jax.tree_util.tree_flatten_with_path(state)[0]})
""")


@pytest.fixture(scope="module")
def docs_recipe_reads(bn_run, tmp_path_factory):
  """The trainer's checkpoint (``bn_run``) and one that a 2-device process saved (the state it
  saved: ``saved.npz``), each read by the docs' recipe (one process reads both):
  ``{"trainer": (restored, base), "two_devices": (restored, base)}``."""
  _, trainer = bn_run
  two = tmp_path_factory.mktemp("two_devices")
  env = {**os.environ, "JAX_PLATFORMS": "cpu",
         "XLA_FLAGS": process_launcher.forced_devices_flags(2)}
  proc = subprocess.run([sys.executable, "-c", _TWO_DEVICE_SAVE,
                         str(two / "runs" / "my-run" / "checkpoints"),
                         str(two / "saved.npz")], capture_output=True, text=True, env=env,
                        timeout=300, check=False)
  assert proc.returncode == 0, proc.stderr[-4000:]
  restored = _restore_with_the_docs_recipe(trainer, two)
  return {"trainer": (restored[0], trainer), "two_devices": (restored[1], two)}


@pytest.mark.slow
def test_plain_orbax_restores_the_trainers_checkpoint_without_safe_optax(bn_run,
                                                                         docs_recipe_reads):
  out, _ = bn_run
  _assert_restored(docs_recipe_reads["trainer"][0], out.state._asdict())
  assert int(out.state.step) == 2 * 7  # the last checkpoint: two epochs of seven batches


@pytest.mark.slow
def test_the_docs_recipe_reads_a_checkpoint_of_two_devices_on_one(docs_recipe_reads):
  restored, base = docs_recipe_reads["two_devices"]
  # The state the 2-device process saved, rebuilt here (1 device) from its leaves.
  params = {"Dense_0": {"kernel": jnp.zeros((3, 4)), "bias": jnp.zeros(4)}}
  like = {"step": jnp.int32(0), "rng": jax.random.PRNGKey(0), "params": params,
          "model_state": {"batch_stats": {"BatchNorm_0": {"mean": jnp.zeros(4),
                                                          "var": jnp.zeros(4)}}},
          "opt_state": safe_optax.safe(0.1, 0.5, penalty=1e-2, total_steps=10).init(params)}
  saved = np.load(base / "saved.npz")
  names = ["/".join(str(getattr(p, "key", p)) for p in path)
           for path, _ in jax.tree_util.tree_flatten_with_path(like)[0]]
  state = jax.tree.unflatten(jax.tree.structure(like), [saved[n] for n in names])
  assert float(state["model_state"]["batch_stats"]["BatchNorm_0"]["var"][0]) == 2.0
  _assert_restored(restored, state)


@pytest.mark.slow
def test_the_export_is_the_deployed_model_at_the_requested_sparsity(bn_run, monkeypatch):
  out, base = bn_run
  workdir = base / "runs" / "my-run"
  params = load_file(str(workdir / "sparse_params.safetensors"))
  masks = load_file(str(workdir / "masks.safetensors"))
  stats = load_file(str(workdir / "batch_stats.safetensors"))
  want = {k.partition("/")[2]: v for k, v in _flat(out.sparse_params, "p").items()}
  assert sorted(params) == sorted(want) == ["BatchNorm_0/bias", "BatchNorm_0/scale",
                                            "Dense_0/bias", "Dense_0/kernel",
                                            "Dense_1/bias", "Dense_1/kernel"]
  for name, value in want.items():
    np.testing.assert_array_equal(params[name], value, err_msg=name)
  # The dense model differs: the export is the projected one.
  assert not np.array_equal(params["Dense_0/kernel"], np.asarray(out.state.params["Dense_0"]["kernel"]))
  assert sorted(masks) == ["Dense_0/kernel", "Dense_1/kernel"]  # the prunable leaves
  for name, mask in masks.items():
    assert mask.dtype == np.bool_
    np.testing.assert_array_equal(mask, params[name] != 0, err_msg=name)
  kept, size = sum(int(m.sum()) for m in masks.values()), sum(m.size for m in masks.values())
  assert kept == safe_optax.num_keep(size, BN_CONFIG["sparsity"])
  assert 1 - kept / size == pytest.approx(BN_CONFIG["sparsity"], abs=1 / size)
  for name, value in _flat(out.model_state["batch_stats"], "s").items():
    np.testing.assert_array_equal(stats[name.partition("/")[2]], value)
  with safe_open(str(workdir / "masks.safetensors"), "np") as f:
    metadata = f.metadata()
  assert metadata["method"] == "safe" and metadata["structure"] == "Global()"
  assert metadata["safe_optax_version"] == safe_optax.__version__
  assert float(metadata["target_sparsity"]) == BN_CONFIG["sparsity"]
  assert float(metadata["sparsity"]) == out.results["final"]["sparsity"] == 1 - kept / size
  assert json.loads(metadata["config"])["mlp_features"] == [12]
  # The docs' recipe reads the same.
  monkeypatch.chdir(base)
  recipe: dict = {}
  exec(_docs_python_blocks()[1], recipe)  # pylint: disable=exec-used
  assert recipe["metadata"] == metadata and recipe["sparsity"] == 1 - kept / size


MLP_CONFIG = dict(epochs=2, warmup_epochs=0)


@pytest.fixture(scope="module")
def whole_mlp_run(tmp_path_factory):
  return train.train_and_evaluate(test_train.tiny_config(**MLP_CONFIG),
                                  tmp_path_factory.mktemp("whole"), data_dir=None,
                                  dataset=test_train.tiny_dataset())


def _assert_same(a, b):
  la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
  assert len(la) == len(lb)
  for x, y in zip(la, lb):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


@pytest.mark.slow
def test_a_relative_workdir_resumes_from_another_current_directory(whole_mlp_run, tmp_path,
                                                                   monkeypatch, caplog):
  config, data = test_train.tiny_config(**MLP_CONFIG), test_train.tiny_dataset()
  (tmp_path / "elsewhere").mkdir()
  monkeypatch.chdir(tmp_path)
  stopped = train.train_and_evaluate(config, os.path.join("runs", "a"), data_dir=None,
                                     dataset=data, stop_after_epoch=1)
  assert int(stopped.state.step) == 7
  assert checkpoint_lib.Checkpointer(tmp_path / "runs" / "a" / "checkpoints").latest_step() == 7
  monkeypatch.chdir(tmp_path / "elsewhere")
  with caplog.at_level("INFO", logger="safe_optax.vision.train"):
    resumed = train.train_and_evaluate(config, os.path.join("..", "runs", "a"), data_dir=None,
                                       dataset=data)
  assert "resuming from step 7 of 14" in caplog.text
  _assert_same(resumed.state, whole_mlp_run.state)
  assert (tmp_path / "runs" / "a" / "sparse_params.safetensors").is_file()
  assert not (tmp_path / "elsewhere" / "runs").exists()


def _save_format_1(directory, step: int, state) -> None:
  """What the Checkpointer of the development versions before 0.1.0 wrote: the state's leaves
  as one unnamed item."""
  options = ocp.CheckpointManagerOptions(create=True, enable_async_checkpointing=False)
  with ocp.CheckpointManager(directory, options=options) as manager:
    manager.save(step, args=ocp.args.StandardSave(jax.tree.leaves(state)))


def test_a_checkpoint_of_an_unreleased_format_is_refused_naming_restart(tmp_path):
  state = {"params": {"w": jnp.arange(4.0)}, "step": jnp.int32(7)}
  _save_format_1(tmp_path / "old", 7, state)
  with pytest.raises(checkpoint_lib.CorruptCheckpoint,
                     match=r"no 'layout' item: not a checkpoint of .* version 3.*--restart"):
    checkpoint_lib.Checkpointer(tmp_path / "old").restore(7, state)


def test_a_checkpoint_whose_layout_names_another_version_is_refused(tmp_path):
  state = {"params": {"w": jnp.arange(4.0)}, "step": jnp.int32(7)}
  ckpt = checkpoint_lib.Checkpointer(tmp_path)
  ckpt.save(7, state)
  metadata = tmp_path / "7" / checkpoint_lib.LAYOUT_ITEM / "metadata"
  layout = json.loads(metadata.read_text())
  metadata.write_text(json.dumps({**layout, "version": 2}))
  with pytest.raises(checkpoint_lib.CorruptCheckpoint, match="version 2, not .* version 3"):
    checkpoint_lib.Checkpointer(tmp_path).restore(7, state)
  metadata.write_text(json.dumps(layout))
  restored = checkpoint_lib.Checkpointer(tmp_path).restore(7, state)
  np.testing.assert_array_equal(restored["params"]["w"], np.arange(4.0))


class _TwiceX:
  """A pytree node whose two children are both keyed ``x`` (a custom node may do so)."""

  def __init__(self, a, b):
    self.a, self.b = a, b


jax.tree_util.register_pytree_with_keys(
    _TwiceX, lambda n: (((jax.tree_util.GetAttrKey("x"), n.a),
                         (jax.tree_util.GetAttrKey("x"), n.b)), None),
    lambda _, children: _TwiceX(*children))


def test_encode_keys_optax_states_by_path_and_decode_inverts_it():
  params = {"conv": {"kernel": jnp.ones((2, 3))}, "bias": jnp.zeros(3)}
  tx = safe_optax.safe(0.1, 0.5, penalty=1e-2, total_steps=10)
  state = tx.init(params)
  encoded = checkpoint_lib.encode(state)
  leaves = jax.tree_util.tree_flatten_with_path(state)[0]
  assert len(jax.tree.leaves(encoded)) == len(leaves)
  # Every leaf sits at the keys of its path; MaskedNode placeholders leave nothing.
  for path, leaf in leaves:
    node = encoded
    for entry in path:
      node = node[jax.tree_util.keystr((entry,), simple=True)]
    assert node is leaf
  assert jax.tree.structure(state) == jax.tree.structure(checkpoint_lib.decode(encoded, state))
  with pytest.raises(KeyError, match="no leaf"):
    checkpoint_lib.decode({}, state)
  with pytest.raises(ValueError, match="both named 'x'"):
    checkpoint_lib.encode(_TwiceX(jnp.ones(1), jnp.ones(2)))
  assert checkpoint_lib.encode(optax.sgd(0.1).init(params)) == {}  # no leaves


def _largest_data_file(step_folder: pathlib.Path) -> pathlib.Path:
  """The OCDBT data file that holds the params' bytes."""
  return max((p for p in (step_folder / "params").rglob("*") if p.is_file() and p.parent.name == "d"),
             key=lambda p: p.stat().st_size)


def _flip_byte(fraction):
  def damage(step_folder):
    path = _largest_data_file(step_folder)
    data = bytearray(path.read_bytes())
    data[int(fraction * (len(data) - 1))] ^= 0x10
    path.write_bytes(bytes(data))
  return damage


def _truncate(step_folder):
  path = _largest_data_file(step_folder)
  path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def _garbage(relative):
  return lambda step_folder: (step_folder / relative).write_text("{not json")


@pytest.mark.parametrize("damage", [_flip_byte(0.1), _flip_byte(0.5), _flip_byte(0.8), _truncate,
                                    _garbage("params/_METADATA"), _garbage("layout/metadata")],
                         ids=["flip-10%", "flip-50%", "flip-80%", "truncated", "metadata",
                              "layout"])
def test_a_damaged_checkpoint_is_refused_in_one_line_naming_restart(tmp_path, damage):
  values = np.random.default_rng(0).normal(size=(64, 64)).astype(np.float32)
  state = {"params": {"w": jnp.asarray(values)}, "step": jnp.int32(3)}
  checkpoint_lib.Checkpointer(tmp_path).save(3, state)
  damage(tmp_path / "3")
  like = {"params": {"w": jnp.zeros((64, 64))}, "step": jnp.int32(0)}
  with pytest.raises(checkpoint_lib.CorruptCheckpoint) as info:
    checkpoint_lib.Checkpointer(tmp_path).restore(3, like)
  message = str(info.value)
  assert f"checkpoint '{tmp_path / '3'}' is damaged" in message
  assert "--restart" in message and "\n" not in message and len(message) < 400, message


def test_a_checkpoint_records_the_sha256_of_every_item(tmp_path):
  state = {"params": {"w": jnp.arange(3.0)}, "step": jnp.int32(3),
           "rng": jnp.array([1, 2], jnp.uint32)}
  checkpoint_lib.Checkpointer(tmp_path).save(3, state)
  layout = json.loads((tmp_path / "3" / "layout" / "metadata").read_text())
  assert layout["version"] == 3
  assert layout["sha256"] == {"params": checkpoint_lib.digest({"w": np.arange(3.0, dtype=np.float32)}),
                              "step": checkpoint_lib.digest(np.int32(3)),
                              "rng": checkpoint_lib.digest(np.array([1, 2], np.uint32))}


@pytest.mark.slow
def test_the_trainer_refuses_a_damaged_checkpoint_and_restart_retrains(whole_mlp_run, tmp_path):
  config, data = test_train.tiny_config(**MLP_CONFIG), test_train.tiny_dataset()
  train.train_and_evaluate(config, tmp_path, data_dir=None, dataset=data, stop_after_epoch=1)
  _flip_byte(0.5)(tmp_path / "checkpoints" / "7")
  with pytest.raises(checkpoint_lib.CorruptCheckpoint, match="--restart"):
    train.train_and_evaluate(config, tmp_path, data_dir=None, dataset=data)
  assert not (tmp_path / "results.json").exists()
  again = train.train_and_evaluate(config, tmp_path, data_dir=None, dataset=data, restart=True)
  _assert_same(again.state, whole_mlp_run.state)


def test_the_cli_reports_a_damaged_checkpoint_in_one_line(tmp_path, monkeypatch, capsys):
  from safe_optax.vision import cli
  import test_vision_interrupt  # noqa: E402  (the tiny MNIST files)

  def damaged(*args, **kwargs):
    raise checkpoint_lib.CorruptCheckpoint(tmp_path / "run" / "checkpoints" / "3", "item 'params' "
                                           "does not match its SHA-256")

  monkeypatch.setattr(train, "train_and_evaluate", damaged)
  test_vision_interrupt._write_tiny_mnist(tmp_path)  # pylint: disable=protected-access
  with pytest.raises(SystemExit) as exit_info:
    cli.main(["train", "--preset", "mlp-mnist", "--data-dir", str(tmp_path), "--workdir",
              str(tmp_path / "run"), "--test-only-split", "48", "24", "--no-progress"])
  err = capsys.readouterr().err
  assert exit_info.value.code == 2 and "Traceback" not in err
  assert err.strip().splitlines() == [
      f"safe-optax-vision train: error: checkpoint '{tmp_path / 'run' / 'checkpoints' / '3'}' is "
      "damaged (item 'params' does not match its SHA-256); it cannot be resumed: rerun with "
      "--restart (restart=True) to discard the run's checkpoints and train from the start."]
