"""benchmarks/claims/llm_block_studies.py: the edge rule that extends a selection grid."""

import math
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks" / "claims"))
from llm_block_studies import edge_rule_pick  # noqa: E402  pylint: disable=wrong-import-position


def test_an_edge_pick_extends_the_grid_until_it_is_inside():
  tried = []

  def error(lam):  # lowest at 1e-5, below the first grid
    tried.append(lam)
    return abs(math.log10(lam) + 5)

  pick, grid, inside = edge_rule_pick(error, [1e-4, 1e-3, 1e-2], 10.0)
  assert (pick, inside) == (1e-5, True)
  assert grid == [1e-6, 1e-5, 1e-4, 1e-3, 1e-2]
  assert sorted(set(tried)) == grid  # every value in the returned grid was scored


def test_an_interior_pick_keeps_the_grid_and_integer_grids_stay_integer():
  pick, grid, inside = edge_rule_pick(lambda steps: abs(steps - 120), [60, 120, 250], 2.0,
                                      integer=True)
  assert (pick, grid, inside) == (120, [60, 120, 250], True)
  pick, grid, inside = edge_rule_pick(lambda steps: -steps, [60, 120, 250], 2.0, integer=True)
  assert not inside and pick == grid[-1] == 1000 and all(isinstance(g, int) for g in grid)


def test_the_extensions_are_bounded():
  pick, grid, inside = edge_rule_pick(lambda lr: lr, [1e-3, 3e-3, 1e-2], 3.0, max_extensions=2)
  assert not inside and pick == grid[0] and len(grid) == 5
