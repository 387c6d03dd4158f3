"""The benchmark's measurement plumbing on small CPU shapes.

Speed and memory are measured on the GPU, not asserted here; these check that
what the benchmark runs computes the right thing, that its bisection finds
the boundary, that its time statistic survives a slow round, and what its
table and plot show.
"""

from __future__ import annotations

import dataclasses
import gzip
import importlib.util
import json
import os

import jax
import numpy as np
import pytest

from mst_jax import reference
from mst_jax.bench import cases, cli, fit, measure, options, report
from mst_jax.bench.cases import CASES, make_inputs, make_loss

SMALL = dict(tokens=300, dim=24, vocab=1031, dtype="float32", seq_len=100)


@pytest.fixture(autouse=True)
def _restore_preallocation(monkeypatch):
  """``cli.main`` sets XLA_PYTHON_CLIENT_PREALLOCATE; keep it to each test."""
  monkeypatch.setenv(
    "XLA_PYTHON_CLIENT_PREALLOCATE",
    os.environ.get("XLA_PYTHON_CLIENT_PREALLOCATE", "false"),
  )


@pytest.mark.parametrize(
  "case", ["llama", "llama_sft_prefix", "llama_sft_random", "gpt2_dv"]
)
@pytest.mark.parametrize("impl", ["naive", "naive_cast", "mst_jax:chunk_size=64"])
def test_every_impl_computes_the_masked_mean_loss(case, impl):
  case = dataclasses.replace(CASES[case], **SMALL)
  hidden, weight, labels, where = make_inputs(case, seed=3)
  dv = case.weight_layout == "dv"
  assert weight.shape == ((case.dim, case.vocab) if dv else (case.vocab, case.dim))
  got = jax.jit(make_loss(impl, case))(hidden, weight, labels, where)
  with jax.enable_x64():
    want = reference.linear_cross_entropy(
      np.asarray(hidden, np.float64),
      np.asarray(weight, np.float64),
      labels,
      where=where,
      weight_layout=case.weight_layout,
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
    ["--tokens", "256", "--impls", "naive", "mst_jax", "tokamax", "--reps", "1"]
    + ["--rounds", "1", "--out", str(tmp_path)]
  )
  table = capsys.readouterr().out
  assert (
    "cpu@256: a narrow head with Qwen-2's vocabulary, for a CPU: N=256 D=64"
    " V=151,936 float32" in table
  )
  assert "ratios against naive, the faster naive head here" in table
  if importlib.util.find_spec("tokamax") is None:
    assert "Not installed, so not measured: tokamax." in table
    assert "  tokamax" not in table
  results = json.loads((tmp_path / "results.json").read_text())
  assert [r["impl"] for r in results["rows"]][:2] == ["naive", "mst_jax"]


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
    options.parse_args(["--fit", "--fit-from", "64", "--fit-ran", "64"])
  args = options.parse_args(["--fit", "--fit-from", "64", "--fit-ran", "56"])
  assert args.fit_ran == 56


@pytest.mark.parametrize(
  "argv, message",
  [
    (["--impls", "bogus"], "unknown implementation 'bogus' (known: naive,"),
    (["--impls", "mst_jax:chunk_sise=256"], "takes no option 'chunk_sise'"),
    (["--tokens", "0"], "--tokens: must be at least 1"),
    (["--reps", "-2"], "--reps: must be at least 1"),
    (["--rounds", "0"], "--rounds: must be at least 1"),
    (["--kernels"], "this jax runs on a CPU"),
    (["--memory"], "read a GPU's peak memory"),
  ],
)
def test_bad_arguments_are_named_before_anything_runs(capsys, argv, message):
  with pytest.raises(SystemExit) as exit_info:
    options.parse_args(argv, on_gpu=False)
  assert exit_info.value.code == 2
  assert message in capsys.readouterr().err


def test_a_run_that_measured_nothing_fails(tmp_path, monkeypatch):
  """Every implementation failing is an error exit, not a table of failures."""

  def failing(spec, case):
    raise ValueError(f"{spec} broke")

  monkeypatch.setattr(cases, "make_loss", failing)
  with pytest.raises(SystemExit, match="nothing was measured"):
    cli.main(
      ["--cases", "cpu", "--tokens", "64", "--impls", "naive", "--out", str(tmp_path)]
    )


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


def _rows(accuracy=False):
  """Result rows of a CPU run at two N, as ``cli.run_sweep`` makes them."""
  rows = []
  for n, times in ((512, (90.0, 80.0, 85.0)), (1024, (170.0, 160.0, 150.0))):
    case = CASES["cpu"].with_tokens(n)
    for impl, ms in zip(("naive", "naive_cast", "mst_jax"), times, strict=True):
      row = {"case": case.name, "impl": impl, "tokens": n, "time_ms": ms}
      row.update(spread=1.02, tflops=0.1, extra_bytes=n * 2**16 * (impl != "mst_jax"))
      row.update(extra_method="compiled temp", **report.problem(case))
      if accuracy:
        row.update(dhidden_rel_err=1e-7, dweight_rel_err=2e-7)
      rows.append(row)
    rows.append({"case": case.name, "impl": "jax_cce", "tokens": n})
    rows[-1]["skipped"] = "jax_cce takes no token mask"
  cli._add_ratios(rows)
  return rows


def test_table_states_the_problem_the_baseline_and_what_is_missing():
  timing = {"reps": 3, "rounds": 3, "max_rounds": 7}
  table = report.format_table(
    _rows(), not_installed=["tokamax"], timing=timing, accuracy=False
  )
  lines = table.splitlines()
  assert lines[0] == (
    "cpu@512: a narrow head with Qwen-2's vocabulary, for a CPU: N=512 D=64 V=151,936"
    " float32, weight [V, D],"
    " gradients of hidden and weight"
  )
  assert "  ratios against naive_cast, the faster naive head here" in lines
  assert "  ratios against mst_jax" not in table
  naive = next(line for line in lines if line.startswith("  naive "))
  assert naive.split()[-2:] == ["1.12", "1.000"]  # 90 / 80 ms; same memory
  # The 1024 case's baseline is naive_cast too; mst_jax is faster than it.
  assert "  not run: jax_cce (jax_cce takes no token mask)" in lines
  assert "Not installed, so not measured: tokamax." in lines
  assert not any(line.startswith("  tokamax") for line in lines)
  assert "dh err" not in lines[1] and "run with --accuracy" in table
  assert "naive (float32 logits" in table and "naive_cast (logits in the input" in table
  assert "median over rounds of each round's fastest step" in table
  assert "issue" not in table
  with_errors = report.format_table(_rows(accuracy=True), accuracy=True)
  assert "dh err" in with_errors.splitlines()[1]
  assert "run with --accuracy" not in with_errors


def test_help_defines_the_baselines_and_the_statistic(capsys):
  with pytest.raises(SystemExit):
    options.parse_args(["--help"])
  text = capsys.readouterr().out
  assert "naive       float32 logits" in text and "naive_cast  logits" in text
  assert "median over rounds of each round's fastest step" in text
  assert "issue" not in text


def test_peers_that_are_not_installed_are_listed(monkeypatch):
  monkeypatch.setattr(report, "PEERS", {"jax_cce": "no_such_module", "tokamax": "json"})
  assert cli.not_installed(["naive", "jax_cce:x=1", "tokamax", "mst_jax"]) == [
    "jax_cce"
  ]


def test_round_statistic_ignores_a_slow_round():
  # mst_jax is faster; a slow spell covers most of its first round and all of
  # its second. Every step's median would put it behind naive.
  naive = [[100, 101, 102], [100, 103, 101], [101, 100, 102]]
  mst = [[250, 260, 91], [300, 310, 320], [90, 92, 91]]
  assert measure.round_statistic(mst) == 91 < measure.round_statistic(naive) == 100
  steps = sorted(t for r in mst for t in r)
  assert steps[len(steps) // 2] > 100


def _fake_steps(durations: dict[str, list[list[float]]]):
  """Steps that advance a fake clock by the given seconds, round after round."""
  now = [0.0]
  queues = {name: [t for r in rounds for t in r] for name, rounds in durations.items()}

  def step(name):
    now[0] += queues[name].pop(0)

  steps = {name: (lambda name=name: step(name)) for name in durations}
  return steps, lambda: now[0]


def test_timing_adds_rounds_while_they_disagree():
  slow = [[300, 300], [250, 260], [90, 95], [91, 90], [93, 90], [90, 90], [90, 90]]
  steady = [[100, 100]] * 7
  steps, clock = _fake_steps({"naive": steady, "mst_jax": slow})
  times = measure.time_rounds(steps, 2, 3, 7, clock=clock)
  # Two slow rounds of three disagree; the fifth round settles it.
  assert len(times["mst_jax"]) == len(times["naive"]) == 5
  assert measure.round_statistic(times["mst_jax"]) == 90
  steps, clock = _fake_steps({"naive": steady, "mst_jax": [[90, 91]] * 7})
  assert len(measure.time_rounds(steps, 2, 3, 7, clock=clock)["naive"]) == 3
  steps, clock = _fake_steps({"a": [[100], [300], [100]] * 3})
  assert len(measure.time_rounds(steps, 1, 3, 4, clock=clock)["a"]) == 3


def test_each_round_starts_one_name_later():
  order = []
  steps = {name: (lambda name=name: order.append(name)) for name in "abc"}
  times = measure.time_rounds(steps, 2, 4, 4, clock=lambda: 0.0)
  assert all(len(t) == 4 for t in times.values())
  rounds = ["".join(order[i : i + 6 : 2]) for i in range(0, 24, 6)]
  assert rounds == ["abc", "bca", "cab", "abc"]


def test_plot_has_both_legends_shapes_in_the_title_and_plain_ticks(tmp_path):
  matplotlib = pytest.importorskip("matplotlib")
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  rows = _rows()
  assert report.plot(rows, str(tmp_path / "bench.png"), "cpu") is None
  assert (tmp_path / "bench.png").stat().st_size > 10_000
  fig = report.figure(rows, "cpu")
  fig.canvas.draw()
  time_ax, memory_ax = fig.axes
  for ax in (time_ax, memory_ax):
    labels = [t.get_text() for t in ax.get_legend().get_texts()]
    assert labels == ["naive", "naive_cast", "mst_jax"]
  # naive and naive_cast coincide in memory: different markers keep both seen.
  markers = {line.get_marker() for line in memory_ax.get_lines()}
  assert len(markers) == 3
  title = fig._suptitle.get_text()
  assert "D=64, V=151,936, float32" in title and "cpu" in title
  ticks = [t.get_text() for t in time_ax.get_yticklabels() if t.get_text()]
  assert ticks and all(t.endswith(" ms") and "10^" not in t for t in ticks)
  assert [t.get_text() for t in time_ax.get_xticklabels()] == ["512", "1,024"]
  bars = report.figure([r for r in rows if r["tokens"] == 512], "cpu")
  assert all(ax.get_legend() is not None for ax in bars.axes)
  plt.close(fig)
  plt.close(bars)


def test_gpu_default_is_one_case_in_three_processes(tmp_path, monkeypatch, capsys):
  """The default run on a GPU, with the measuring processes faked: one timing
  process for the Llama-3 head, one memory process per implementation, the
  naive head with bfloat16 logits (naive_cast) the one baseline."""
  calls = []

  def fake(spec, case, what, reps, env, granularity=8192, timeout=None, rounds=3):
    calls.append((what, case.name, spec))
    if what.startswith("time"):
      rows = [
        {"case": case.name, "impl": s, "tokens": case.tokens, "time_ms": 40.0 + i}
        for i, s in enumerate(spec)
      ]
      return {"rows": rows}
    if spec == "naive_cast":
      return {"what": what, "error": "exit 1: out of memory"}
    return {"what": what, "extra_bytes": 2**30, "compiled_here": False}

  monkeypatch.setattr(measure, "run_isolated", fake)
  monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
  cli.main(["--out", str(tmp_path)])
  impls = ["naive_cast", "mst_jax"]
  assert calls[0] == ("time", "llama", impls)
  assert calls[1:] == [("memory", "llama", impl) for impl in impls]
  table = capsys.readouterr().out
  assert "llama: Llama-3-8B head: N=8,192 D=4,096 V=128,256 bfloat16" in table
  assert "no memory for naive_cast: memory: exit 1: out of memory" in table
  calls.clear()
  cli.main(["--full", "--out", str(tmp_path)])
  assert [c[1] for c in calls if c[0] == "time"] == options.GPU_CASES
  assert sum(c[0] == "memory" for c in calls) == 2 * len(options.GPU_CASES)
  assert sum(c[0] == "first_call" for c in calls) == 2 * len(options.GPU_CASES)


def _script(folder: str, name: str):
  """A module of scripts/ or tools/ (not a package), loaded from its file."""
  path = os.path.join(os.path.dirname(__file__), "..", folder, f"{name}.py")
  spec = importlib.util.spec_from_file_location(name, path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def test_plots_takes_each_settings_last_invocation(tmp_path):
  """scripts/plots.py: ratios against naive_cast of the same invocation, the
  last invocation given wins, options in any order are one setting; the
  first call is drawn only where it peaks higher; it writes PNGs."""
  plots = _script("scripts", "plots")
  mib = 2**20

  def row(impl, ms, extra, first=None):
    return dict(
      case="llama",
      impl=impl,
      time_ms=ms,
      extra_bytes=extra * mib,
      first_call_extra_bytes=None if first is None else first * mib,
    )

  one = {"rows": [row("naive_cast", 40.0, 6000), row("mst_jax:a=1,b=2", 44.0, 90)]}
  two = {"rows": [row("naive_cast", 50.0, 6000), row("mst_jax:b=2,a=1", 45.0, 80)]}
  found = plots.frontier_points([one, two])
  assert found == {
    "naive_cast": (1.0, 6000.0, None),
    "mst_jax:a=1,b=2": (0.9, 80.0, None),
  }
  found = plots.frontier_points(
    [{"rows": [*one["rows"], row("mst_jax", 38, 2000, 4000)]}]
  )
  assert found["mst_jax"] == (0.95, 2000.0, 4000.0)
  fig = plots.frontier_figure(found, "test")
  labels = fig.axes[0].get_legend_handles_labels()[1]
  assert labels[-1] == "first call" and "a=1, b=2" in labels
  fig.savefig(tmp_path / "f.png")
  assert (tmp_path / "f.png").stat().st_size > 0
  plots.main(["--data", str(plots.DATA), "--out", str(tmp_path)])
  for name in ("bench_h200_llama.png", "frontier_h200_llama.png"):
    assert (tmp_path / name).stat().st_size > 0


def test_plots_tables_are_the_documents_tables():
  """The README's and docs/benchmarks.md's H200 tables are the rows
  scripts/plots.py prints from docs/data/h200_heads.json."""
  plots = _script("scripts", "plots")
  heads = plots.load("h200_heads.json")
  root = plots.ROOT
  for name, readme in [("README.md", True), ("docs/benchmarks.md", False)]:
    text = (root / name).read_text()
    rows = plots.table_rows(heads, readme=readme)
    assert rows and not [r for r in rows if r not in text], name
  assert plots.cells(heads["measurements"][0]) == (
    "40.95 ms, 5.87 GiB",
    "38.81 ms, 2.02 GiB",
    "0.95x",
    "0.34x",
  )


def test_profile_step_sums_device_kernels_per_step(tmp_path, monkeypatch):
  """tools/profile_step.py: device kernels summed by name and divided by
  the steps (host events left out); a traced CPU step runs end to end."""
  profile_step = _script("tools", "profile_step")
  monkeypatch.setitem(
    profile_step.CASES, "cpu", dataclasses.replace(CASES["cpu"], **SMALL)
  )
  meta = lambda pid, name: dict(
    ph="M", name="process_name", pid=pid, args={"name": name}
  )
  kernel = lambda pid, name, dur, ts: dict(ph="X", pid=pid, name=name, dur=dur, ts=ts)
  events = [
    meta(1, "/host:CPU"),
    meta(2, "/device:GPU:0"),
    kernel(1, "host_op", 9000.0, 0.0),
    kernel(2, "gemm", 3000.0, 0.0),
    kernel(2, "ce", 500.0, 2000.0),  # on another stream, inside the first gemm
    kernel(2, "gemm", 5000.0, 3100.0),  # 100 us after the first gemm
    kernel(2, "ce", 500.0, 8400.0),  # 300 us after it
  ]
  trace = tmp_path / "trace.json.gz"
  with gzip.open(trace, "wt") as f:
    json.dump({"traceEvents": events}, f)
  assert profile_step.kernel_times(str(trace), steps=2) == {"gemm": 4.0, "ce": 0.5}
  idle = profile_step.idle_time(str(trace), steps=2)
  assert idle["gaps"] == [(300.0, "gemm", "ce"), (100.0, "gemm", "gemm")]
  assert idle["span_ms"] == pytest.approx(8.9 / 2)
  assert idle["idle_ms"] == pytest.approx(0.4 / 2)
  result = profile_step.profile("cpu", "mst_jax", steps=1, warm_up=0)
  assert result["kernel_ms_per_step"] == sum(result["kernels"].values())


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_kernel_passes_time_every_backend(monkeypatch, dtype):
  """``--kernels``: each pass of XLA, Triton and (bfloat16) Mosaic GPU tiles,
  in interpret mode here; in place, chained, on bfloat16 logits."""
  from mst_jax.bench import kernels

  monkeypatch.setattr(kernels, "warm_up", lambda: None)
  monkeypatch.setattr(kernels, "copy_bandwidth", lambda: 1e12)
  args = options.parse_args(
    ["--kernels", "--kernel-groups", "ce", "--chunk-shapes", "64x640"]
    + ["--blocks", "1x128x4", "--reps", "2"]
    + ["--logits-dtype", dtype, "--mosaic-tiles", "128x2x8"],
    on_gpu=False,
  )
  rows = kernels.run_kernels(args)
  impls = ["xla", "pallas 1x128x4"] + ["mosaic 128x2x8"] * (dtype == "bfloat16")
  assert [(r["impl"], r["pass"]) for r in rows] == [
    (impl, p) for impl in impls for p in ("forward", "backward", "fused")
  ]
  assert all(r["ms"] > 0 and r["chunk"] == "64x640" for r in rows)


def test_gemm_clock_reads_samples_under_load(tmp_path):
  """scripts/gemm_clock.py: nvidia-smi rows parsed (unreadable ones left
  out), means over the rows above half the power limit; a small GEMM runs
  end to end (on a CPU without samples)."""
  gemm_clock = _script("scripts", "gemm_clock")
  log = tmp_path / "smi.csv"
  log.write_text(
    "1980, 120.50, 700.00, 0x0000000000000000\n"
    "1500, 690.00, 700.00, 0x0000000000000004\n"
    "[N/A], 650.00, 700.00, 0x0000000000000004\n"
    "1400, 680.00, 700.00, 0x0000000000000004\n"
  )
  samples = gemm_clock.read_samples(str(log))
  assert [s["mhz"] for s in samples] == [1980.0, 1500.0, 1400.0]
  summary = gemm_clock.summarise(samples)
  assert summary["loaded_samples"] == 2
  assert summary["mean_mhz"] == pytest.approx(1450.0)
  assert summary["mean_watts"] == pytest.approx(685.0)
  assert summary["throttle_reasons"] == ["0x0000000000000004"]
  result = gemm_clock.main(["--shape", "24", "64", "136", "--seconds", "0.05"])
  assert result["shape"] == [24, 64, 136] and result["ms"] > 0
