"""benchmarks/perf/packed_conv.py: the three ways of writing R runs' convolutions agree."""

import json
import sys

from hypothesis import given, settings, strategies as st
import jax
import jax.numpy as jnp
from jax import lax
import numpy as np
import pytest

from benchmarks.perf import packed_conv


def _reference(x, w):
  """Each run's convolution on its own, by a plain loop over runs, at full precision."""
  return np.stack([np.asarray(lax.conv_general_dilated(
      x[r], w[r], (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC"),
      precision=lax.Precision.HIGHEST)) for r in range(x.shape[0])])


@pytest.mark.slow
@settings(max_examples=25, deadline=None)
@given(runs=st.integers(1, 3), batch=st.integers(1, 2), height=st.integers(1, 6),
       width=st.integers(1, 5), channels=st.integers(1, 4), out=st.integers(1, 4),
       kernel=st.sampled_from([1, 2, 3, 5]), seed=st.integers(0, 2**16))
def test_every_form_matches_each_runs_own_convolution(runs, batch, height, width, channels, out,
                                                      kernel, seed):
  rng = np.random.default_rng(seed)
  x = rng.standard_normal((runs, batch, height, width, channels)).astype(np.float32)
  w = rng.standard_normal((runs, kernel, kernel, channels, out)).astype(np.float32)
  expected = _reference(x, w)
  with jax.default_matmul_precision("highest"):
    for form in packed_conv.FORMS:
      np.testing.assert_allclose(packed_conv.packed(form)(x, w), expected, rtol=1e-4, atol=1e-4,
                                 err_msg=form)


def test_the_gradients_agree_too():
  rng = np.random.default_rng(0)
  x = jnp.asarray(rng.standard_normal((3, 2, 5, 4, 3)), jnp.float32)
  w = jnp.asarray(rng.standard_normal((3, 3, 3, 3, 2)), jnp.float32)
  with jax.default_matmul_precision("highest"):
    results = {f: packed_conv.forward_backward(f)(x, w) for f in packed_conv.FORMS}
  loss, (dx, dw) = results["grouped"]
  for form in ("im2col", "loop"):
    other_loss, (other_dx, other_dw) = results[form]
    np.testing.assert_allclose(other_loss, loss, rtol=1e-5)
    np.testing.assert_allclose(other_dx, dx, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(other_dw, dw, rtol=1e-4, atol=1e-4)
  assert float(jnp.abs(dw).sum()) > 0  # the comparison is not of zeros


def test_bad_forms_are_refused():
  with pytest.raises(ValueError, match="form must be one of"):
    packed_conv.packed("winograd")


@pytest.mark.slow
def test_the_benchmark_writes_each_cell_with_its_ratio_to_the_grouped_form(tmp_path, monkeypatch):
  monkeypatch.setattr(packed_conv, "SHAPES", ((4, 2),))
  out = tmp_path / "packed.json"
  packed_conv.main(["--runs", "1", "2", "--batch", "2", "--dtypes", "float32", "--steps", "1",
                    "--warmup", "0", "--out", str(out)])
  cells = json.loads(out.read_text())["cells"]
  assert [(c["runs"], c["size"], c["channels"]) for c in cells] == [(1, 4, 2), (2, 4, 2)]
  for cell in cells:
    assert sorted(cell["forms"]) == sorted(packed_conv.FORMS)
    assert cell["ratio_to_grouped"]["grouped"] == 1.0
    assert cell["ratio_to_grouped"]["im2col"] == pytest.approx(
        cell["forms"]["im2col"]["median_ms"] / cell["forms"]["grouped"]["median_ms"])


def test_a_run_count_below_one_is_refused(tmp_path, capsys):
  with pytest.raises(SystemExit):
    packed_conv.main(["--runs", "0", "--out", str(tmp_path / "x.json")])
  assert "--runs and --batch take counts >= 1, got [0] and 128" in capsys.readouterr().err
