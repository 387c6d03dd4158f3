"""Every Python block in the README and docs/ runs on its own, as a reader
would paste it: in a fresh process, on the CPU."""

from __future__ import annotations

import os
import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
_BLOCK = re.compile(r"```python\n(.*?)```", re.S)


def _blocks():
  for path in DOCS:
    if not path.exists():  # an installed package without its docs
      continue
    for index, code in enumerate(_BLOCK.findall(path.read_text())):
      # The README's in the quick run; the reference docs' with -m slow.
      marks = () if path.name == "README.md" else (pytest.mark.slow,)
      yield pytest.param(code, id=f"{path.name}-{index}", marks=marks)


def test_the_docs_have_python_blocks():
  assert sum(1 for _ in _blocks()) >= 6


@pytest.mark.parametrize("code", list(_blocks()))
def test_python_block_runs_on_its_own(code):
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  env["JAX_PLATFORMS"] = "cpu"
  result = subprocess.run(
    [sys.executable, "-c", code],
    env=env,
    capture_output=True,
    text=True,
    timeout=300,
    cwd=ROOT,
  )
  assert result.returncode == 0, result.stderr[-3000:]


def test_every_option_is_explained_in_at_most_60_words():
  """docs/api.md's options: each a table row whose meaning takes at most 60
  words (a heuristic that needs more is made internal instead)."""
  rows = re.findall(
    r"^\| `(\w+)=[^|]*\| (.*) \|$", (ROOT / "docs" / "api.md").read_text(), re.M
  )
  assert len(rows) >= 15
  long = {name: len(text.split()) for name, text in rows if len(text.split()) > 60}
  assert not long, long
