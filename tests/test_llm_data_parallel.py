"""LLM block pruning split over several devices gives what one device gives.

Each layout runs in its own process (the device count is fixed when JAX
starts): one CPU device, and two forced host devices over which every batch of
calibration windows is split (``block.calibration_mesh``).
"""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import process_launcher  # tests/process_launcher.py: forced-device XLA flags

SCRIPT = textwrap.dedent("""
    import dataclasses
    import sys
    import numpy as np
    import jax
    from safe_optax.llm import block, model, prune, prune_config

    out, devices = sys.argv[1], int(sys.argv[2])
    assert jax.local_device_count() == devices, jax.devices()
    mesh = block.calibration_mesh()
    if devices == 1:
      assert mesh is None
    else:
      assert mesh.size == devices
      placed = block.place(mesh, np.zeros((4, 3, 2), np.float32))
      # The windows are split over the devices, not copied to each.
      assert placed.sharding.spec == jax.sharding.PartitionSpec("data"), placed.sharding
      assert {s.data.shape[0] for s in placed.addressable_shards} == {4 // devices}
    cfg = model.LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32,
                            num_layers=2, num_heads=4, num_kv_heads=2)
    params = model.init_params(cfg)
    calib = np.random.default_rng(0).integers(0, 32, (8, 8))
    results = {}
    for method in ("safe-plus", "sparsegpt", "wanda"):
      pc = prune_config.PruneConfig(method, epochs=3, batch_size=4, dual_every=2, learning_rate=3e-3,
                             chunk=4)
      pruned, report = prune.prune_model(cfg, params, calib, pc, progress=False)
      for i in range(cfg.num_layers):
        for path, leaf in jax.tree_util.tree_leaves_with_path(pruned[f"layers_{i}"]):
          name = "/".join(str(getattr(k, "key", k)) for k in path)
          results[f"{method}/{i}/{name}"] = np.asarray(leaf)
        results[f"{method}/{i}/error"] = np.asarray(report["blocks"][i]["relative_error"])
    if devices > 1:
      # Several devices: prune_models runs SAFE's lanes one after another over the mesh,
      # so each lane is its lone run over the mesh, bit for bit, and no block says "pack".
      pc = prune_config.PruneConfig("safe-plus", epochs=3, batch_size=4, dual_every=2,
                                    learning_rate=3e-3, chunk=4)
      cfgs = [pc, dataclasses.replace(pc, seed=1)]
      calibs = [calib, np.random.default_rng(1).integers(0, 32, (8, 8))]
      lanes = prune.prune_models(cfg, params, calibs, cfgs, progress=False)
      for (got, report), c, p in zip(lanes, calibs, cfgs):
        want, _ = prune.prune_model(cfg, params, c, p, progress=False)
        jax.tree.map(np.testing.assert_array_equal, got, want)
        assert all(b["lanes"] == 2 and "pack" not in b for b in report["blocks"]), report
      results["lanes_over_mesh_equal_lone"] = np.asarray(True)
    np.savez(out, **results)
""")


def _run(tmp_path: pathlib.Path, devices: int) -> dict[str, np.ndarray]:
  env = dict(os.environ)
  env["XLA_FLAGS"] = process_launcher.forced_devices_flags(devices)
  root = str(pathlib.Path(__file__).resolve().parents[1])
  env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
  out = tmp_path / f"devices{devices}.npz"
  proc = subprocess.run([sys.executable, "-c", SCRIPT, str(out), str(devices)], env=env,
                        capture_output=True, text=True, timeout=600)
  assert proc.returncode == 0, proc.stderr[-3000:]
  with np.load(out) as f:
    return {k: f[k] for k in f.files}


@pytest.fixture(scope="module")
def layouts(tmp_path_factory):
  tmp = tmp_path_factory.mktemp("llm_dp")
  return _run(tmp, 1), _run(tmp, 2)


# SAFE+ runs SAFE's whole step (SAM's two gradients, the dual update) and needs Wanda's
# activation norms besides; SparseGPT's Hessians are the other cross-device sum. SAFE alone
# would add only the magnitude score, which reads no calibration data.
@pytest.mark.slow
@pytest.mark.parametrize("method", ["safe-plus", "sparsegpt", "wanda"])
def test_two_devices_prune_like_one(layouts, method):
  one, two = layouts
  names = [k for k in one if k.startswith(method + "/")]
  assert names and set(names) == {k for k in two if k.startswith(method + "/")}
  for name in names:
    if name.endswith("error"):
      np.testing.assert_allclose(two[name], one[name], rtol=1e-4, err_msg=name)
      continue
    # The same mask, and the same kept values up to the order of the cross-device sums.
    np.testing.assert_array_equal(two[name] != 0, one[name] != 0, err_msg=name)
    np.testing.assert_allclose(two[name], one[name], rtol=1e-4, atol=1e-6, err_msg=name)


@pytest.mark.slow
def test_lanes_run_one_after_another_over_a_mesh(layouts):
  """``prune_models`` with several devices: each lane equals its lone run (checked, bit for
  bit, inside the two-device process)."""
  one, two = layouts
  assert "lanes_over_mesh_equal_lone" not in one and bool(two["lanes_over_mesh_equal_lone"])


@pytest.mark.slow
def test_pruning_did_prune(layouts):
  # Not a vacuous agreement: every method left half of each kernel at zero.
  one, _ = layouts
  for name, value in one.items():
    if name.endswith("kernel"):
      assert np.isclose((value == 0).mean(), 0.5, atol=0.02), name
