"""The README's Python examples run as written (in order, sharing names)."""

from __future__ import annotations

import pathlib
import re

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"


def test_readme_python_blocks_run():
  blocks = re.findall(r"```python\n(.*?)```", README.read_text(), re.S)
  assert len(blocks) >= 3
  namespace: dict = {}
  for block in blocks:
    exec(compile(block, str(README), "exec"), namespace)
  assert float(namespace["loss"]) > 0
