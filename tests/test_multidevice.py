"""Runs tests/multidevice on 8 simulated CPU devices, in a fresh process.

``--xla_force_host_platform_device_count`` must be set before JAX starts, so
it cannot apply to this process; the multi-device tests run in a child pytest
with it, and this test fails if any of them fails.
"""

from __future__ import annotations

import os
import pathlib
import re
import subprocess
import sys

import pytest

HERE = pathlib.Path(__file__).resolve().parent


@pytest.mark.parametrize(
  "part", ["not slow", pytest.param("slow", marks=pytest.mark.slow)]
)
def test_multidevice_suite_on_8_cpu_devices(part):
  """The child runs the same part of its suite as this run (quick or slow)."""
  env = dict(os.environ)
  env["XLA_FLAGS"] = (
    env.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
  ).strip()
  env["JAX_PLATFORMS"] = "cpu"
  result = subprocess.run(
    [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", part]
    + ["multidevice"],
    env=env,
    capture_output=True,
    text=True,
    cwd=HERE,
  )
  summary = result.stdout[-4000:] + result.stderr[-2000:]
  assert result.returncode == 0, summary
  assert re.search(r"\d+ passed", result.stdout), summary
  assert not re.search(r"\d+ (failed|skipped|error)", result.stdout), summary
