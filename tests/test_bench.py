"""The benchmark's measurement plumbing on small CPU shapes.

Speed and memory are measured on the GPU, not asserted here; these check that
what the benchmark runs computes the right thing and that its bisection finds
the boundary.
"""

from __future__ import annotations

import dataclasses
import json

import jax
import numpy as np
import pytest

from mst_jax import reference
from mst_jax.bench import cli, fit, measure
from mst_jax.bench.cases import CASES, make_inputs, make_loss

SMALL = dict(tokens=300, dim=24, vocab=1031, dtype="float32", seq_len=100)


@pytest.mark.parametrize("case", ["llama", "llama_sft_prefix", "llama_sft_random"])
@pytest.mark.parametrize("impl", ["naive", "naive_cast", "mst_jax:chunk_size=64"])
def test_every_impl_computes_the_masked_mean_loss(case, impl):
  case = dataclasses.replace(CASES[case], **SMALL)
  hidden, weight, labels, where = make_inputs(case, seed=3)
  got = jax.jit(make_loss(impl, case))(hidden, weight, labels, where)
  with jax.enable_x64():
    want = reference.linear_cross_entropy(
      np.asarray(hidden, np.float64),
      np.asarray(weight, np.float64),
      labels,
      where=where,
    )
  np.testing.assert_allclose(float(got), float(want), rtol=1e-5)
  if case.mask == "none":
    assert bool(where.all())
  else:
    assert 0.3 < 1 - float(where.mean()) < 0.7


def test_isolated_measurement_reports_time_and_accuracy():
  case = dataclasses.replace(CASES["llama"], **SMALL)
  row = measure.run_isolated("mst_jax", case, "time", 2, env={})
  assert row["median_ms"] > 0 and row["extra_bytes"] >= 0, row
  errors = measure.run_here("naive", case, "accuracy")
  assert errors["dhidden_rel_err"] < 1e-5 and errors["dweight_rel_err"] < 1e-5


@pytest.mark.parametrize("boundary", [0, 1, 17, 40, 63, 64])
def test_bisection_finds_the_largest_fitting_multiple(boundary):
  calls = []

  def fits(n):
    calls.append(n)
    return n <= boundary * 8

  got = fit.largest_fitting(fits, 8, 512, 8, log=lambda _: None)
  want = 0 if boundary == 0 else min(boundary, 64) * 8
  assert got == want
  assert len(calls) <= 1 + 6 + 6  # doubling from 8 to 512, then bisection


def test_footprint_holds_naive_logits_and_mst_does_not():
  case = dataclasses.replace(CASES["llama"], dim=32, vocab=4099, dtype="bfloat16")
  at = lambda spec, n: fit.step_footprint(spec, case.with_tokens(n))
  logits = 4096 * case.vocab * 4
  assert at("naive", 4096) > logits > at("naive", 1024)
  assert at("mst_jax:memory_budget=4194304", 4096) < logits / 2


def test_fit_rejects_a_device_without_memory_stats(tmp_path):
  with pytest.raises(SystemExit, match="memory_stats"):
    cli.main(["--fit", "--cases", "cpu", "--impls", "naive", "--out", str(tmp_path)])


def test_fit_rejects_cases_over_several_devices(tmp_path):
  with pytest.raises(SystemExit, match="spans devices"):
    cli.main(["--fit", "--cases", "llama_16k_vp", "--out", str(tmp_path)])


def test_cpu_sweep_writes_table_and_json(tmp_path, capsys):
  cli.main(
    ["--tokens", "256", "--impls", "naive", "mst_jax", "--reps", "1"]
    + ["--out", str(tmp_path)]
  )
  table = capsys.readouterr().out
  assert "mst_jax" in table and "naive" in table
  assert (tmp_path / "results.json").exists()


def test_parallel_cases_skip_without_their_devices():
  case = dataclasses.replace(
    CASES["llama_16k_vp"], **SMALL, devices=len(jax.devices()) + 1
  )
  row = measure.run_here("mst_jax", case, "time", 1)
  assert "median_ms" not in row
  assert f"needs {case.devices} devices" in row["skipped"]


@pytest.mark.parametrize("limit", [8, 96, 200, 488, 504])
def test_confirmation_halves_then_bisects_real_runs(limit):
  """Steps run below a limit the footprint (start) overestimates."""
  tried = []

  def runs(n):
    tried.append(n)
    return n <= limit

  ran, failed = fit.confirm_by_running(runs, 504, 8, 20, log=lambda _: None)
  assert ran == (limit if limit < 504 else 504)
  assert failed is None if limit >= 504 else failed - ran <= 8
  assert all(n % 8 == 0 for n in tried) and len(set(tried)) == len(tried)


def test_confirmation_stops_after_its_attempts():
  tried = []
  ran, failed = fit.confirm_by_running(
    lambda n: tried.append(n) or False, 4096, 8, 3, log=lambda _: None
  )
  assert (ran, failed, tried) == (0, 1024, [4096, 2048, 1024])


@pytest.mark.parametrize("limit", [200, 256, 304, 504])
def test_confirmation_given_a_size_that_runs_bisects_towards_it(limit):
  tried = []

  def runs(n):
    tried.append(n)
    return n <= limit

  ran, failed = fit.confirm_by_running(runs, 504, 8, 20, log=lambda _: None, ran=200)
  assert ran == limit and (failed is None if limit == 504 else failed - ran <= 8)
  assert all(n > 200 for n in tried) and len(set(tried)) == len(tried)
  assert len(tried) <= 1 + 6  # one start, then bisection of (200, 504] by 8s


def test_fit_ran_must_be_below_fit_from():
  with pytest.raises(SystemExit):
    cli.parse_args(["--fit", "--fit-from", "64", "--fit-ran", "64"])
  assert cli.parse_args(["--fit", "--fit-from", "64", "--fit-ran", "56"]).fit_ran == 56


def test_fit_from_skips_the_bisection_and_confirms_from_there(tmp_path, monkeypatch):
  calls = []

  def fake(impl, case, what, reps, env, granularity=8192, timeout=None):
    calls.append((what, case.tokens))
    return {"error": "oom"} if case.tokens > 40 else {"extra_bytes": 1}

  monkeypatch.setattr(measure, "run_isolated", fake)
  cli.main(
    ["--fit", "--fit-from", "64", "--fit-granularity", "8", "--cases", "cpu"]
    + ["--impls", "naive", "--out", str(tmp_path)]
  )
  assert all(what == "memory" for what, _ in calls) and calls[0] == ("memory", 64)
  row = json.loads((tmp_path / "fit.json").read_text())["rows"][0]
  assert row["largest_tokens"] == 40 and row["start_tokens"] == 64


def test_isolated_run_that_overruns_its_timeout_is_an_error():
  case = dataclasses.replace(CASES["cpu"], **SMALL)
  # Far below the child's start-up (importing jax alone takes longer), so the
  # run times out however fast the machine is.
  row = measure.run_isolated("naive", case, "memory", 0, {}, timeout=0.02)
  assert row["error"].startswith("timed out after")
  assert "extra_bytes" not in row
