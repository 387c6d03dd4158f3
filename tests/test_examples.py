"""The examples: each one's --help, and those that run in seconds on a CPU,
run as a user would, down to their verdict line."""

from __future__ import annotations

import importlib.util
import pathlib
import re
import subprocess
import sys

import pytest

EXAMPLES = pathlib.Path(__file__).parent.parent / "examples"


def _run(script: str, *args: str) -> subprocess.CompletedProcess:
  return subprocess.run(
    [sys.executable, str(EXAMPLES / script), *args],
    capture_output=True,
    text=True,
    timeout=300,
  )


def _load(name: str, monkeypatch):
  """The example ``name`` imported as a module (its main() not run)."""
  spec = importlib.util.spec_from_file_location(
    f"example_{name}", EXAMPLES / f"{name}.py"
  )
  module = importlib.util.module_from_spec(spec)
  monkeypatch.setitem(sys.modules, spec.name, module)  # dataclasses look it up
  spec.loader.exec_module(module)
  return module


@pytest.mark.parametrize("name", sorted(p.stem for p in EXAMPLES.glob("*.py")))
def test_help_describes_the_example_and_every_flag_with_its_default(
  name, monkeypatch, capsys
):
  monkeypatch.setenv("COLUMNS", "200")  # no "(default: ...)" split over lines
  monkeypatch.setattr(sys, "argv", [f"{name}.py", "--help"])
  module = _load(name, monkeypatch)
  with pytest.raises(SystemExit) as exit_:
    module.main()
  assert exit_.value.code == 0
  text = capsys.readouterr().out
  words = lambda s: " ".join(s.split())
  assert words(module.__doc__.split("\n\n")[0]) in words(text)
  options = re.split(r"\n(?=  -)", text.split("\noptions:\n")[1].strip("\n"))
  assert len(options) > 2, text
  for option in options:
    if not option.startswith("  -h, --help"):
      assert "(default: " in option, option


def test_train_tiny_lm_without_the_examples_extra_says_what_to_install(
  monkeypatch, capsys
):
  monkeypatch.setitem(sys.modules, "tokenizers", None)  # import fails
  module = _load("train_tiny_lm", monkeypatch)
  with pytest.raises(SystemExit) as exit_:
    module.main(["--steps", "1"])
  assert exit_.value.code == 2
  out, err = capsys.readouterr()
  assert out == ""
  assert err == (
    "this example needs tokenizers, from the examples extra:"
    ' pip install -e ".[examples]"\n'
  )


def test_multi_device_layouts_match_one_device():
  result = _run("multi_device.py", "--tokens", "256", "--dim", "64", "--vocab", "2048")
  assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
  lines = result.stdout.splitlines()
  assert len(lines) == 6, result.stdout
  assert lines[-1].startswith("verdict: the sharded layouts match one device's"), lines


def test_long_context_compares_the_heads_speed():
  result = _run("long_context.py", "--no-fit", "--speed-seq", "128", "--steps", "1")
  assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
  last = result.stdout.splitlines()[-1]
  assert re.fullmatch(
    r"verdict: LMHeadLoss's tokens/s at T=128 are \d+\.\d\dx the naive head's", last
  ), result.stdout


def test_rl_policy_gradient_raises_the_reward():
  result = subprocess.run(
    [sys.executable, str(EXAMPLES / "rl_policy_gradient.py"), "--iterations", "45"],
    capture_output=True,
    text=True,
    timeout=300,
  )
  assert result.returncode == 0, result.stderr[-2000:]
  assert result.stdout.splitlines()[-1].startswith("verdict: the reward rose, from")


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


def test_top_k_distill_helps_the_student():
  small = "--train-tokens 2048 --eval-tokens 2048 --steps 60 --vocab 256"
  result = _run("top_k_distill.py", *small.split())
  assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
  last = result.stdout.splitlines()[-1]
  assert last.startswith("verdict: the stored top-16 helped:"), result.stdout


def test_multi_process_matches_one_process():
  """Two processes joined by jax.distributed (CPU collectives), 2 devices each."""
  result = subprocess.run(
    [sys.executable, str(EXAMPLES / "multi_process.py"), "--processes", "2"],
    capture_output=True,
    text=True,
    timeout=300,
  )
  assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
  last = result.stdout.splitlines()[-1]
  assert last.startswith("verdict: the multi-process results match one process"), last
