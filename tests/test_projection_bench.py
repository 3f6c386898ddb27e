"""benchmarks/perf/projection.py's per_output part times what ``project_topk(PerOutput())`` does."""

import pathlib
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import safe_optax
from safe_optax import _select

ROOT = pathlib.Path(__file__).resolve().parents[1]
from benchmarks.perf import projection as bench


@pytest.mark.slow
def test_per_output_projection_is_project_topk_per_output():
  shapes = [(40, 24), (24, 40), (24, 8)]  # rows of 40 and 24 entries: the long-row kernel
  key = jax.random.key(1)
  kernels = [jnp.round(jax.random.normal(jax.random.fold_in(key, i), s), 1)  # ties
             for i, s in enumerate(shapes)]
  counts = [jnp.int32(safe_optax.num_keep(s[0], 0.5)) for s in shapes]
  got = jax.jit(bench.per_output_projection(_select))(kernels, counts)
  want, _ = safe_optax.project_topk(kernels, 0.5, structure=safe_optax.PerOutput())
  for g, w in zip(got, want):
    np.testing.assert_array_equal(np.asarray(g), np.asarray(w))


def test_block_shapes_are_the_models_seven_matrices():
  small = bench.PER_OUTPUT_BLOCKS["smollm2_135m"]
  assert sum(a * b for a, b in small) == 3_538_944
  assert sum(a * b for a, b in bench.PER_OUTPUT_BLOCKS["llama2_7b"]) == 202_375_168


def test_unknown_part_is_refused(monkeypatch, capsys):
  monkeypatch.setattr(sys, "argv", ["projection.py", "--parts", "per_output,bogus"])
  with pytest.raises(SystemExit):
    bench.main()
  assert "--parts: unknown ['bogus']" in capsys.readouterr().err
