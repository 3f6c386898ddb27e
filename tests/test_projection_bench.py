"""benchmarks/perf/projection.py: its per_output table times ``project_topk(PerOutput())``; --parts."""

import sys

import pytest

from benchmarks.perf import projection as bench
from benchmarks.perf import projection_tables


def test_block_shapes_are_the_models_seven_matrices():
  small = projection_tables.PER_OUTPUT_BLOCKS["smollm2_135m"]
  assert sum(a * b for a, b in small) == 3_538_944
  assert sum(a * b for a, b in projection_tables.PER_OUTPUT_BLOCKS["llama2_7b"]) == 202_375_168


def test_unknown_part_is_refused(monkeypatch, capsys):
  monkeypatch.setattr(sys, "argv", ["projection.py", "--parts", "per_output,bogus"])
  with pytest.raises(SystemExit):
    bench.main()
  assert "--parts: unknown ['bogus']" in capsys.readouterr().err
