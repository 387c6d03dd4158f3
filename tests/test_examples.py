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


def test_distill_tiny_lm_compares_the_students():
  tiny = "--corpus-mib 0.25 --teacher-steps 30 --student-steps 20 --batch 8"
  tiny += " --seq-len 32 --teacher-dim 64 --eval-batches 4"
  result = subprocess.run(
    [sys.executable, str(EXAMPLES / "distill_tiny_lm.py"), *tiny.split()],
    capture_output=True,
    text=True,
    timeout=300,
  )
  assert result.returncode == 0, result.stderr[-2000:]
  lines = result.stdout.splitlines()
  assert [x.split()[0] for x in lines[2:]] == [
    "teacher",
    "student",
    "student",
    "verdict:",
  ]
  assert "nan" not in result.stdout, result.stdout


def test_multi_process_matches_one_process():
  """Two processes joined by jax.distributed (CPU collectives), 2 devices each."""
  result = subprocess.run(
    [sys.executable, str(EXAMPLES / "multi_process.py"), "--processes", "2"],
    capture_output=True,
    text=True,
    timeout=300,
  )
  assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
  assert "results match one process" in result.stdout, result.stdout
