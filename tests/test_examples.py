"""The examples that run in seconds on a CPU, run as a user would."""

from __future__ import annotations

import pathlib
import subprocess
import sys

EXAMPLES = pathlib.Path(__file__).parent.parent / "examples"


def test_rl_policy_gradient_raises_the_reward():
  result = subprocess.run(
    [sys.executable, str(EXAMPLES / "rl_policy_gradient.py"), "--iterations", "45"],
    capture_output=True,
    text=True,
    timeout=300,
  )
  assert result.returncode == 0, result.stderr[-2000:]
  assert "the reward rose" in result.stdout, result.stdout
