"""benchmarks/perf/cifar_pack_throughput.py: FLOPs counted before the backend's passes, recounts."""

import json
import pathlib
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks" / "perf"))
import cifar_pack_throughput as bench  # noqa: E402  pylint: disable=wrong-import-position
from safe_optax.vision import configs  # noqa: E402  pylint: disable=wrong-import-position


def _config(batch=8):
  return configs.get_config("resnet20x2-cifar10", method="safe", sparsity=0.9, batch_size=batch,
                            dtype="float32")


def _conv_flops(batch):
  """ResNet-20x2's convolutions and classifier, forward, by hand: 2 x MACs per image."""
  macs, size, channels = 3 * 32 * 9 * 32 * 32, 32, 32  # the stem: 3 -> 32 channels at 32 x 32
  for stage, width in enumerate((32, 64, 128)):
    for block in range(3):
      stride = 2 if stage and not block else 1
      size //= stride
      macs += channels * width * 9 * size * size + width * width * 9 * size * size
      if channels != width:
        macs += channels * width * size * size  # the 1 x 1 projection shortcut
      channels = width
  return 2 * batch * (macs + channels * 10)


def test_the_lowered_count_holds_the_convolutions_and_grows_with_the_pack():
  lone = bench.flops_of(bench.lowered_step(_config(), 1).lowered)
  # SAM's two gradients: two forward and two backward passes, the backward about twice the forward
  forward = _conv_flops(8)
  assert 5.0 * forward < lone < 7.5 * forward
  packed = bench.flops_of(bench.lowered_step(_config(), 3).lowered)
  assert packed == pytest.approx(3 * lone, rel=0.02)


def test_a_recount_replaces_the_flops_keeps_the_times_and_says_how(tmp_path):
  path = tmp_path / "gpu.json"
  cells = [{"model": "resnet20x2", "dtype": "float32", "runs": 1, "plain_step": {"median_ms": 2.0},
            "flops_per_step": 1.0e6, "images_per_second": 4000.0, "mean_step_ms": 2.0},
           {"model": "resnet20x2", "dtype": "float32", "runs": 3, "skipped": "past --deadline-s"}]
  path.write_text(json.dumps({"settings": {"method": "safe", "sparsity": 0.9, "batch": 8},
                              "device_kind": "NVIDIA H200", "platform": "gpu", "cells": cells}))
  report = bench.recount_flops(str(path))
  assert json.loads(path.read_text()) == report
  cell = report["cells"][0]
  expected = bench.flops_of(bench.lowered_step(_config(), 1).lowered)
  assert cell["flops_per_step"] == expected and cell["flops_per_step_compiled"] == 1.0e6
  assert cell["flops_per_second"] == pytest.approx(expected / 2.0e-3)
  assert cell["plain_step"] == {"median_ms": 2.0} and cell["speedup_vs_lone_float32"] == 1.0
  assert "skipped" in report["cells"][1] and "flops_per_step" not in report["cells"][1]
  assert "lowered" in report["flops_recounted"]["how"]
