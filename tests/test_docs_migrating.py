"""The ```python blocks of docs/migrating.md run, in order, in one namespace.

Blocks that need packages this project does not install are written as
``{code-block} python`` with a caption saying *not run*; every other fenced
block must be ``python`` (run here) or a shell block, so no example is left
out of the run by accident.
"""

import os
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
PAGES = ["migrating.md"]
FENCE = re.compile(r"^```(?P<info>[^\n]*)\n(?P<body>.*?)^```$", re.M | re.S)


def _blocks(page: str) -> list[tuple[str, str]]:
  text = (ROOT / "docs" / page).read_text(encoding="utf-8")
  return [(m.group("info").strip(), m.group("body")) for m in FENCE.finditer(text)]


@pytest.mark.parametrize("page", PAGES)
def test_every_block_is_run_or_says_why_not(page):
  blocks = _blocks(page)
  assert sum(info == "python" for info, _ in blocks) >= 5
  for info, body in blocks:
    if info == "{code-block} python":
      caption = body.splitlines()[0]
      assert caption.startswith(":caption:") and "not run" in caption, caption
    else:
      assert info in ("python", "bash"), info


@pytest.mark.slow
@pytest.mark.parametrize("page", PAGES)
def test_python_blocks_run(page, tmp_path):
  namespace: dict = {"__name__": f"docs_{page}"}
  cwd = os.getcwd()
  os.chdir(tmp_path)  # a block that writes files writes them here
  try:
    for i, (info, body) in enumerate(_blocks(page)):
      if info == "python":
        exec(compile(body, f"docs/{page} python block {i}", "exec"), namespace)  # pylint: disable=exec-used
  finally:
    os.chdir(cwd)
