"""benchmarks/perf/notebook_time.py runs each notebook in the compile mode it names."""

import pytest

nbformat = pytest.importorskip("nbformat")
pytest.importorskip("nbclient")
pytest.importorskip("ipykernel")

# After the skips: the benchmark imports nbclient at the top.
from benchmarks.perf import notebook_time as bench  # noqa: E402  pylint: disable=wrong-import-position


@pytest.mark.parametrize("mode, flag", [("fast", "1"), ("optimized", "None")])
def test_each_mode_gets_its_own_kernel_environment(tmp_path, monkeypatch, mode, flag):
  monkeypatch.setenv("JAX_DISABLE_MOST_OPTIMIZATIONS", "1")  # as under the test suite
  nb = nbformat.v4.new_notebook(cells=[
      nbformat.v4.new_markdown_cell("not timed"),
      nbformat.v4.new_code_cell("import os\n"
                                "print(os.environ.get('JAX_DISABLE_MOST_OPTIMIZATIONS'),\n"
                                "      os.environ['SAFE_OPTAX_NOTEBOOK_BUDGET'])")])
  path = tmp_path / "env.ipynb"
  nbformat.write(nb, path)
  row, executed = bench.time_notebook(path, mode)
  assert row["mode"] == mode and [c["cell"] for c in row["cells"]] == [1]
  assert row["seconds"] >= row["cells"][0]["seconds"] > 0
  assert executed.cells[1].outputs[0]["text"].strip() == f"{flag} ci"
  assert not nbformat.read(path, as_version=4).cells[1].get("outputs")  # file untouched
