"""Tests of the vision trainer's logs: per-step rows, mask churn, TensorBoard event files.

Cost: one tiny SAFE configuration (an MLP on 72 generated 8x8 images, batch 16:
four full batches and a short one per epoch, two epochs, every step logged)
compiles once; the run, the stopped-and-resumed run and the host reference of
the mask churn reuse its programs.
"""

from __future__ import annotations

import collections
import json
import math
import struct

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import safe_optax
from safe_optax.vision import checkpoint as checkpoint_lib
from safe_optax.vision import configs
from safe_optax.vision import input_pipeline
from safe_optax.vision import metrics
from safe_optax.vision import train
from safe_optax.vision import datasets
from safe_optax.vision import programs as programs_lib

pytest.importorskip("tensorboardX")
from tensorboardX.proto import event_pb2  # pylint: disable=wrong-import-position

N_TRAIN, N_TEST, BATCH, EPOCHS, K, LR, LAM = 72, 24, 16, 2, 2, 0.3, 1e-2
SPE = math.ceil(N_TRAIN / BATCH)
BATCH_SIZES = [BATCH] * (N_TRAIN // BATCH) + [N_TRAIN % BATCH]
CONFIG = configs.validate(configs.Config(
    model="mlp", mlp_features=(16,), dataset="mnist", method="safe", sparsity=0.8,
    epochs=EPOCHS, warmup_epochs=1, batch_size=BATCH, learning_rate=LR, eval_batch_size=24,
    augment=False, penalty=LAM, dual_every=K, bnt_samples=32, log_every=1))


def tiny_dataset() -> input_pipeline.Dataset:
  """4 classes of 8x8 images whose brightness grows with the class."""
  rng = np.random.default_rng(1)
  labels = rng.integers(0, 4, N_TRAIN + N_TEST).astype(np.int32)
  images = (60 * labels[:, None, None, None]
            + rng.integers(0, 50, (len(labels), 8, 8, 1))).astype(np.uint8)
  return input_pipeline.Dataset(images[:N_TRAIN], labels[:N_TRAIN], images[N_TRAIN:],
                                labels[N_TRAIN:], ("a", "b", "c", "d"))


def read_scalars(logdir) -> dict[str, list[tuple[int, float]]]:
  """Every scalar of the event files in ``logdir``: ``{tag: [(step, value), ...]}``.

  Event files are TFRecords (length, its CRC, the ``Event`` proto, its CRC),
  read here without TensorBoard.
  """
  scalars = collections.defaultdict(list)
  for path in sorted(logdir.glob("events.out.tfevents.*")):
    data, pos = path.read_bytes(), 0
    while pos < len(data):
      (length,) = struct.unpack("<Q", data[pos:pos + 8])
      event = event_pb2.Event.FromString(data[pos + 12:pos + 12 + length])
      pos += 12 + length + 4
      for value in event.summary.value:
        scalars[value.tag].append((event.step, value.simple_value))
  return dict(scalars)


def read_records(workdir) -> list[dict]:
  with open(workdir / "metrics.jsonl", encoding="utf-8") as f:
    return [json.loads(line) for line in f]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
  workdir = tmp_path_factory.mktemp("logged")
  outcome = train.train_and_evaluate(CONFIG, workdir, data_dir=None, dataset=tiny_dataset(),
                                     tensorboard=True)
  return workdir, outcome


@pytest.mark.slow
def test_step_rows_match_the_epoch_sums_and_the_schedules(run):
  workdir, _ = run
  records = read_records(workdir)
  total = EPOCHS * SPE
  for record in records:
    rows = record["steps"]
    first = record["epoch"] * SPE
    assert [r["step"] for r in rows] == list(range(first + 1, first + SPE + 1))
    # The epoch's mean loss and accuracy are the batch-size-weighted means of its steps'.
    assert sum(r["loss"] * n for r, n in zip(rows, BATCH_SIZES)) / N_TRAIN == pytest.approx(
        record["train_loss"], rel=1e-5)
    assert sum(r["accuracy"] * n for r, n in zip(rows, BATCH_SIZES)) / N_TRAIN == (
        pytest.approx(record["train_accuracy"], abs=1e-6))
    for r in rows:
      t = r["step"] - 1  # the step's own count
      lr = LR * t / SPE if t < SPE else LR * 0.5 * (1 + math.cos(math.pi * (t - SPE)
                                                                  / (total - SPE)))
      assert r["learning_rate"] == pytest.approx(lr, rel=1e-5, abs=1e-7)
      assert r["penalty"] == pytest.approx(LAM * 0.5 * (1 - math.cos(math.pi * t / total)),
                                           rel=1e-5, abs=1e-9)
      assert r["sparsity"] == 0.0  # SAFE trains dense weights
    # The last row is logged from the state the epoch ends with.
    assert rows[-1]["constraint_distance"] == pytest.approx(record["distance_to_z"], rel=1e-6)
    assert record["sparsity"] == 0.0 and record["images_per_second"] > 0


@pytest.mark.slow
def test_mask_churn_rows_are_the_dual_updates_after_the_first(run):
  workdir, _ = run
  records = read_records(workdir)
  steps = [r["step"] for record in records for r in record["dual_updates"]]
  # Dual updates at counts K, 2K, ... (count 0 has no previous mask); a row's step is count + 1.
  assert steps == [t + 1 for t in range(K, EPOCHS * SPE, K)]
  for record in records:
    churn = [r["mask_churn"] for r in record["dual_updates"]]
    assert all(0.0 <= c <= 1.0 for c in churn)
    assert record["mask_churn"] == pytest.approx(np.mean(churn))
  assert max(r["mask_churn"] for record in records for r in record["dual_updates"]) > 0


@pytest.mark.slow
def test_mask_churn_matches_masks_read_on_the_host(run):
  """The same run stepped by hand: z read back after every step, churn counted with numpy."""
  del run  # compiled the programs
  data = tiny_dataset()
  programs = programs_lib.build_programs(CONFIG, N_TRAIN, data.num_classes, (8, 8, 1))
  state = programs.init(jax.random.PRNGKey(CONFIG.seed))

  def mask():
    z = safe_optax.find_admm_state(state.opt_state).z
    return np.concatenate([np.asarray(leaf).ravel() != 0
                           for leaf in jax.tree.leaves(z)])  # MaskedNodes have no leaves

  expected, previous = [], None
  for indices in datasets.epoch_batches(N_TRAIN, BATCH, CONFIG.seed, 0):
    count = int(state.step)
    state = programs_lib.run_step(programs, CONFIG, state, *datasets.gather_batch(
        programs.mesh, (data.train_images, data.train_labels), indices), count)
    if count % K == 0:
      current = mask()
      if previous is not None:
        expected.append((count + 1, np.mean(previous != current)))
      previous = current
  _, dual_updates = programs.step_logger.rows(state.metrics.log)
  assert [r["step"] for r in dual_updates] == [s for s, _ in expected]
  np.testing.assert_allclose([r["mask_churn"] for r in dual_updates],
                             [c for _, c in expected], rtol=1e-6)


def _admm_churn(params, steps: int) -> np.ndarray:
  """Mask churn of ADMM with learning rate 0 (x never moves) over ``steps`` dual updates."""
  tx = safe_optax.admm(0.0, 0.5, penalty=1.0, dual_every=1)
  logger = metrics.StepLogger(every=1, steps_per_epoch=steps,
                              learning_rate=lambda t: jnp.float32(0),
                              penalty=lambda t: jnp.float32(1), dual_every=1)

  @jax.jit
  def step(i, params, opt_state, log):
    updates, new_opt_state = tx.update(jax.tree.map(jnp.ones_like, params), opt_state, params)
    params = optax.apply_updates(params, updates)
    log = logger.record(log, i, loss=jnp.float32(0), accuracy=jnp.float32(0), params=params,
                        old_opt_state=opt_state, opt_state=new_opt_state)
    return params, new_opt_state, log

  opt_state, log = tx.init(params), jax.device_put(logger.empty())
  for i in range(steps):
    params, opt_state, log = step(jnp.int32(i), params, opt_state, log)
  _, dual_updates = logger.rows(log)
  assert [r["step"] for r in dual_updates] == list(range(2, steps + 1))
  return np.array([r["mask_churn"] for r in dual_updates])


def test_mask_churn_is_zero_when_the_mask_cannot_change():
  # x is already on the sparsity set and never moves: u stays 0, z = Proj(x) = x throughout.
  w = jnp.array([[4.0, 0.0, -3.0, 0.0], [0.0, 2.0, 0.0, -1.0]])
  np.testing.assert_array_equal(_admm_churn({"w": w}, 6), 0.0)


def test_mask_churn_counts_the_entries_that_move():
  # x never moves, but u grows the pruned entries (u += x - z) until they overtake kept ones.
  w = jnp.array([[4.0, 3.0, 2.5, 2.0], [1.9, 1.8, 1.7, 1.6]])
  # Count 1: z = Proj(x + 0), the same mask. Then u = x - z: 1.9, 1.8, 1.7, 1.6 on the pruned
  # entries, so at count 2 |x + u| = 4, 3, 2.5, 2 | 3.8, 3.6, 3.4, 3.2: 4, 3.8, 3.6, 3.4 are
  # kept, and 3, 2.5, 2 out and 3.8, 3.6, 3.4 in move 6 of the 8 entries.
  np.testing.assert_allclose(_admm_churn({"w": w}, 3), [0.0, 0.75])


def test_rows_are_logged_every_log_every_steps_of_each_epoch():
  logger = metrics.StepLogger(every=3, steps_per_epoch=7, learning_rate=lambda t: t * 0.5)
  params = {"w": jnp.ones((2, 2)), "b": jnp.ones(2)}

  @jax.jit
  def step(i, log):
    return logger.record(log, i, loss=i * 1.0, accuracy=jnp.float32(1), params=params,
                         old_opt_state=(), opt_state=())

  seen = []
  for epoch in range(2):
    log = jax.device_put(logger.empty())
    for i in range(epoch * 7, epoch * 7 + 7):
      log = step(jnp.int32(i), log)
    steps, dual_updates = logger.rows(log)
    seen += steps
    assert dual_updates == []  # no ADMM state, no dual updates
  # Positions 0, 3, 6 of each 7-step epoch; a row's step is the count after it.
  assert [r["step"] for r in seen] == [1, 4, 7, 8, 11, 14]
  assert [r["loss"] for r in seen] == [0.0, 3.0, 6.0, 7.0, 10.0, 13.0]
  assert [r["learning_rate"] for r in seen] == [0.0, 1.5, 3.0, 3.5, 5.0, 6.5]
  assert all(r["sparsity"] == 0.0 and set(r) == {"step", *metrics.STEP_FIELDS} for r in seen)


@pytest.mark.slow
def test_event_files_hold_the_values_of_metrics_jsonl(run):
  workdir, outcome = run
  scalars = read_scalars(workdir / "tensorboard")
  records = read_records(workdir)
  expected = collections.defaultdict(list)
  for record in records:
    for row in record["steps"]:
      for key, value in row.items():
        if key != "step":
          expected[f"train/{key}"].append((row["step"], value))
    for row in record["dual_updates"]:
      expected["train/mask_churn"].append((row["step"], row["mask_churn"]))
    for key, value in record.items():
      if isinstance(value, (int, float)) and not isinstance(value, bool) and key not in (
          "epoch", "step"):
        expected[f"epoch/{key}"].append((record["step"], value))
  assert set(scalars) == set(expected)
  for tag, points in expected.items():
    # TensorBoard keeps float32.
    assert scalars[tag] == [(s, float(np.float32(v))) for s, v in points], tag
  assert {"epoch/test_accuracy", "epoch/images_per_second", "epoch/distance_to_z",
          "train/penalty", "train/mask_churn"} <= set(scalars)
  # results.json keeps the per-epoch history; the per-step rows are in metrics.jsonl only.
  assert outcome.results["history"] == [metrics.without_step_rows(r) for r in records]


@pytest.mark.slow
def test_no_recompilation_across_epochs(run):
  del run
  programs = programs_lib.build_programs(CONFIG, N_TRAIN, 4, (8, 8, 1))
  # 2 epochs: one step program per batch shape (full, the short last one), the dual update
  # a program of its own.
  used = {(step % SPE == SPE - 1,
           programs_lib.plan(programs, CONFIG, step)[1])
          for step in range(EPOCHS * SPE)}
  assert len(used) == 2 and programs.train._cache_size() == len(used)
  assert programs.dual._cache_size() == 1


@pytest.mark.slow
def test_a_resumed_run_logs_the_rows_of_the_uninterrupted_one(run, tmp_path):
  """The log is part of the checkpointed state: a Ctrl-C mid-epoch loses no row."""
  workdir, _ = run
  data = tiny_dataset()

  def interrupt(step):
    if step == SPE + 2:  # in the middle of the second epoch
      raise KeyboardInterrupt

  with pytest.raises(checkpoint_lib.Interrupted):
    train.train_and_evaluate(CONFIG, tmp_path, data_dir=None, dataset=data, on_step=interrupt,
                             tensorboard=True)
  train.train_and_evaluate(CONFIG, tmp_path, data_dir=None, dataset=data, tensorboard=True)
  strip = lambda r: {k: v for k, v in r.items() if k not in (
      "epoch_seconds", "images_per_second", "includes_compile", "trained_images")}
  assert [strip(r) for r in read_records(tmp_path)] == [strip(r) for r in read_records(workdir)]
  resumed, whole = read_scalars(tmp_path / "tensorboard"), read_scalars(workdir / "tensorboard")
  for tag in whole:
    if tag.startswith("train/"):
      assert resumed[tag] == whole[tag], tag


@pytest.mark.slow
def test_only_process_0_writes_event_files(tmp_path, monkeypatch):
  from safe_optax import distributed  # pylint: disable=import-outside-toplevel
  monkeypatch.setattr(distributed, "is_primary", lambda: False)
  train.train_and_evaluate(CONFIG, tmp_path, data_dir=None,
                           dataset=tiny_dataset(), tensorboard=True, stop_after_epoch=1)
  assert not (tmp_path / "tensorboard").exists() and not (tmp_path / "metrics.jsonl").exists()


def test_tensorboard_without_tensorboardx_is_a_clear_error(tmp_path, monkeypatch):
  monkeypatch.setattr(metrics, "tensorboard_available", lambda: False)
  with pytest.raises(ImportError, match="tensorboardX"):
    train.train_and_evaluate(CONFIG, tmp_path, data_dir=None, dataset=tiny_dataset(),
                             tensorboard=True)
  assert not any(tmp_path.iterdir())
