"""The end of a vision run (safe_optax.vision.finish) and the interrupt path of the loop.

* SAFE+'s final-score program takes its batch as an argument (the training
  set was once a closure constant, folded into the compiled program);
* the evaluation suite rebuilds the deployed model through ``finish.deploy``
  and leaves the run's files alone (it used to re-enter ``train_and_evaluate``,
  which rewrote ``results.json``);
* a Ctrl-C that lands between a donating step's dispatch and the rebinding of
  the state still saves a valid checkpoint of the new step.
"""

from __future__ import annotations

import os
import pathlib
import signal
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from safe_optax.vision import checkpoint as checkpoint_lib
from safe_optax.vision import finish
from safe_optax.vision import train
from safe_optax.vision import programs as programs_lib

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import test_train  # noqa: E402  (the tiny data set and config of the trainer tests)


@pytest.mark.slow
def test_final_scores_take_the_batch_as_an_argument():
  config = test_train.tiny_config(method="safe-plus")
  programs = programs_lib.build_programs(config, test_train.N_TRAIN, 4, (8, 8, 1))
  data = test_train.tiny_dataset()
  params = programs.init(jax.random.PRNGKey(0)).params
  idx = np.arange(config.batch_size, dtype=np.int32)
  images, labels = jnp.asarray(data.train_images), jnp.asarray(data.train_labels)
  jaxpr = jax.make_jaxpr(programs.scores)(params, {}, images[idx], labels[idx],
                                          jax.random.PRNGKey(0))
  # No constant as large as a batch (16 images of 8 x 8) is baked in.
  assert all(np.size(c) < images[idx].size for c in jaxpr.consts)
  first = finish.final_scores(programs, config, params, {}, images, labels, test_train.N_TRAIN)
  other = finish.final_scores(programs, config, params, {}, 255 - images, labels,
                              test_train.N_TRAIN)
  assert programs.scores._cache_size() == 1  # other data, same program
  assert any(not np.allclose(a, b) for a, b in zip(jax.tree.leaves(first),
                                                    jax.tree.leaves(other)))


@pytest.mark.slow
def test_evaluation_deploys_through_finish_and_leaves_the_run_alone(tmp_path, monkeypatch):
  from safe_optax.vision import evaluation  # pylint: disable=import-outside-toplevel
  data = test_train.tiny_dataset()
  config = test_train.tiny_config(epochs=1, warmup_epochs=0)
  trained = train.train_and_evaluate(config, tmp_path, data_dir=None, dataset=data)
  before = {name: (tmp_path / name).read_bytes() for name in ("results.json", "config.json",
                                                               "metrics.jsonl")}

  def no_training(*args, **kwargs):
    raise AssertionError("evaluation re-entered train_and_evaluate")

  monkeypatch.setattr(train, "train_and_evaluate", no_training)
  out = evaluation.evaluate_workdir(tmp_path, data_dir=None, dataset=data, batch_size=16,
                                    suite=("clean",), progress=False)
  assert out["clean"] == pytest.approx(trained.results["final"]["sparse_accuracy"])
  assert out["sparsity"] == trained.results["final"]["sparsity"]
  for name, content in before.items():
    assert (tmp_path / name).read_bytes() == content, name


@pytest.mark.slow
def test_evaluation_of_an_unfinished_run_says_so(tmp_path):
  from safe_optax.vision import evaluation  # pylint: disable=import-outside-toplevel
  data = test_train.tiny_dataset()
  config = test_train.tiny_config(epochs=2, warmup_epochs=0)
  train.train_and_evaluate(config, tmp_path, data_dir=None, dataset=data)
  checkpoints = checkpoint_lib.Checkpointer(tmp_path / "checkpoints")
  last = checkpoints.latest_step()
  checkpoints._manager.delete(last)  # the run's last step is gone: not finished
  checkpoints.close()
  with pytest.raises(RuntimeError, match="not finished"):
    evaluation.evaluate_workdir(tmp_path, data_dir=None, dataset=data, suite=("clean",),
                                progress=False)


@pytest.fixture
def python_sigint_handler():
  previous = signal.signal(signal.SIGINT, signal.default_int_handler)
  yield
  signal.signal(signal.SIGINT, previous)


@pytest.mark.slow
def test_ctrl_c_after_a_donating_step_saves_the_new_state(tmp_path, monkeypatch,
                                                           python_sigint_handler):
  """SIGINT arrives once the step has consumed (donated) the old state, before `state` is
  rebound: the checkpoint holds the new step, and the run resumes to the uninterrupted one."""
  del python_sigint_handler
  data = test_train.tiny_dataset()
  config = test_train.tiny_config(epochs=2)
  real = programs_lib.build_programs

  def interrupting_programs(*args, **kwargs):
    programs = real(*args, **kwargs)

    def step(state, *batch, **kwargs):
      new = programs.train(state, *batch, **kwargs)
      if int(new.step) == 9:
        os.kill(os.getpid(), signal.SIGINT)
        for _ in range(1000):  # the handler runs between these bytecodes, inside the step
          pass
      return new

    return programs._replace(train=step)

  monkeypatch.setattr(programs_lib, "build_programs", interrupting_programs)
  with pytest.raises(checkpoint_lib.Interrupted) as info:
    train.train_and_evaluate(config, tmp_path / "run", data_dir=None, dataset=data)
  assert info.value.step == 9
  monkeypatch.undo()
  resumed = train.train_and_evaluate(config, tmp_path / "run", data_dir=None, dataset=data)
  whole = train.train_and_evaluate(config, tmp_path / "whole", data_dir=None, dataset=data)
  for a, b in zip(jax.tree.leaves(resumed.state), jax.tree.leaves(whole.state)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.slow
def test_finish_writes_results_of_the_deployed_model(tmp_path):
  data = test_train.tiny_dataset()
  config = test_train.tiny_config(method="admm", sparsity=0.5, epochs=1, warmup_epochs=0)
  out = train.train_and_evaluate(config, tmp_path, data_dir=None, dataset=data)
  programs, state = programs_lib.restore_finished(config, tmp_path, data)
  params, model_state = finish.deploy(programs, config, state.params, state.model_state,
                                      data.train_images, data.train_labels,
                                      len(data.train_labels))
  for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(out.sparse_params)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  assert out.results["final"]["sparsity"] == pytest.approx(0.5, abs=0.01)
  assert pathlib.Path(tmp_path / "results.json").is_file()
