"""The benchmark's sweep (``python -m mst_jax.bench``; ``options`` has its help).

``run_sweep`` measures every case's implementations (``measure``) and ``main``
prints the table, writes ``results.json`` and draws ``bench.png``
(``report``); ``--fit`` and ``--kernels`` go to ``run_fit`` and ``kernels``.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
import sys
import tempfile
import time
from collections.abc import Sequence

import jax

from mst_jax.bench import fit, kernels, measure, report
from mst_jax.bench.cases import CASES, parse_impl
from mst_jax.bench.options import parse_args


def not_installed(impls: Sequence[str]) -> list[str]:
  """The peers among ``impls`` whose package is not installed."""
  names = dict.fromkeys(parse_impl(spec)[0] for spec in impls)
  return [
    name
    for name in names
    if name in report.PEERS and importlib.util.find_spec(report.PEERS[name]) is None
  ]


@contextlib.contextmanager
def _progress(total: int):
  """Yields ``say(text, done=False)``: a progress bar (tqdm) or lines on stderr."""
  try:
    from tqdm import tqdm
  except ImportError:
    yield lambda text, done=False: done or print(text, file=sys.stderr, flush=True)
    return
  with tqdm(total=total, unit="case", leave=False) as bar:

    def say(text: str, done: bool = False) -> None:
      bar.set_description(text)
      if done:
        bar.update()

    yield say


def run_sweep(args: argparse.Namespace, impls: Sequence[str]) -> list[dict]:
  """Measures every case's ``impls``; returns the result rows."""
  cases = []
  for name in args.cases:
    base = CASES[name]
    cases += [base.with_tokens(n) for n in args.tokens] if args.tokens else [base]
  rows = []
  # One compilation cache for the whole run: the memory processes load what
  # the timing process compiled (see ``measure``).
  with (
    tempfile.TemporaryDirectory(prefix="mst_jax_bench_cache_") as cache,
    _progress(len(cases)) as say,
  ):
    for case in cases:
      case_rows = _measure_case(args, case, impls, cache, say)
      for row in case_rows:
        row.update(report.problem(case))
      rows += case_rows
      say(case.name, done=True)
  _add_ratios(rows)
  return rows


def _measure_case(args, case, impls: Sequence[str], cache: str, say) -> list[dict]:
  """One case: a timing pass over ``impls``, then memory per implementation."""
  env = measure.isolated_env(cache)
  what = "time+accuracy" if args.accuracy else "time"
  say(f"{case.name}: compiling and timing")
  if args.isolate:
    result = measure.run_isolated(impls, case, what, args.reps, env, rounds=args.rounds)
    rows = result.get("rows") or [{**result, "impl": spec} for spec in impls]
  else:
    rows = measure.run_here(impls, case, what, args.reps, rounds=args.rounds)["rows"]
  for row in rows:
    if "time_ms" not in row:
      continue
    if args.memory:
      say(f"{case.name}: memory of {row['impl']}")
      _merge(row, measure.run_isolated(row["impl"], case, "memory", 0, env))
    if args.first_call:
      say(f"{case.name}: first call of {row['impl']}")
      own = measure.isolated_env(tempfile.mkdtemp(dir=cache))  # it compiles
      _merge(row, measure.run_isolated(row["impl"], case, "first_call", 0, own))
  return rows


def _merge(row: dict, result: dict) -> None:
  """Adds a memory process's fields to a timed row (its failure as a note)."""
  if "error" in result or "skipped" in result:
    what = result.get("what", "memory")
    failure = f"{what}: {result.get('error') or result['skipped']}"
    row["memory_error"] = "; ".join(filter(None, (row.get("memory_error"), failure)))
    return
  row.update({k: v for k, v in result.items() if k not in ("case", "impl", "tokens")})


def run_fit(args: argparse.Namespace) -> list[dict]:
  """The largest N that fits per case and impl, each confirmed by one real step.

  The bisection (compiles only) and each confirmation run in their own fresh
  processes, so no process holds device memory while another measures.
  """
  env = {"XLA_PYTHON_CLIENT_PREALLOCATE": "false"}  # the rest of os.environ too
  rows = []
  for name in args.cases:
    case = CASES[name]
    if case.parallel:
      raise SystemExit(f"--fit bisects one-device cases; {name!r} spans devices")
    for impl in args.impls:
      log = lambda text, impl=impl: print(f"{impl}: {text}", flush=True)
      if args.fit_from:
        tokens = args.fit_from
        row = {"case": name, "impl": impl, "start_tokens": tokens}
      else:
        # Compile-only: autotuning a program far too large spends minutes on
        # allocations it cannot get, and the footprint does not depend on it.
        flags = f"{os.environ.get('XLA_FLAGS', '')} --xla_gpu_autotune_level=0"
        bisect = measure.run_isolated(
          impl, case, "fit", 0, {**env, "XLA_FLAGS": flags}, args.fit_granularity
        )
        if "footprint_tokens" not in bisect:
          raise SystemExit(f"--fit: {bisect.get('skipped') or bisect.get('error')}")
        for line in bisect["log"]:
          log(line)
        tokens = bisect["footprint_tokens"]
        row = {"case": name, "impl": impl, "footprint_tokens": tokens}
        row["capacity"] = bisect["capacity"]
      # The footprint ignores fragmentation and what the step's launch needs
      # beyond its buffers; real steps (each in a fresh process, GEMMs
      # autotuned: untuned, the Llama-3 step took 29x longer) decide.
      checks = {}

      def runs(n, impl=impl, case=case, checks=checks):
        start = time.perf_counter()
        checks[n] = measure.run_isolated(
          impl, case.with_tokens(n), "memory", 0, env, timeout=args.fit_attempt_timeout
        )
        checks[n]["wall_s"] = time.perf_counter() - start
        print(f"  {n:,}: {checks[n]['wall_s']:.0f} s", flush=True)
        if "error" in checks[n]:
          print(f"  error at {n:,}: {checks[n]['error'][-300:]}", flush=True)
        return "error" not in checks[n]

      ran, failed = fit.confirm_by_running(
        runs,
        tokens,
        args.fit_granularity,
        args.fit_confirm_attempts,
        log,
        ran=args.fit_ran,
      )
      if ran:
        row.update(largest_tokens=ran, check=checks.get(ran, "given by --fit-ran"))
      if failed is not None:
        row["failed_run"] = (failed, checks[failed]["error"][-300:])
      print(f"{name} {impl}: {row}", flush=True)
      rows.append(row)
  return rows


def _add_ratios(rows: list[dict]) -> None:
  """Time and memory ratios against the faster naive row of the same case."""
  for row in rows:
    naive = [
      r
      for r in rows
      if r["case"] == row["case"]
      and parse_impl(r["impl"])[0] in ("naive", "naive_cast")
      and "time_ms" in r
    ]
    if not naive or "time_ms" not in row:
      continue
    base = min(naive, key=lambda r: r["time_ms"])
    row["baseline"] = base["impl"]
    row["time_x"] = row["time_ms"] / base["time_ms"]
    if row.get("extra_bytes") is not None and base.get("extra_bytes"):
      row["mem_x"] = row["extra_bytes"] / base["extra_bytes"]


def main(argv: Sequence[str] | None = None) -> None:
  # Before jax starts a GPU client: this process only orchestrates (with
  # --isolate), and a default client would take 75% of the GPU's memory from
  # the processes that measure.
  os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
  args = parse_args(argv)
  device = jax.devices()[0]
  print(
    f"jax {jax.__version__} on {device.platform} ({device.device_kind})", flush=True
  )
  if args.kernels:
    if "ce" in args.kernel_groups:
      kernels.run_kernels(args)
    if "gemm" in args.kernel_groups:
      rows = kernels.run_gemms(args)
      _write_json(args.out, "gemms.json", rows)
    return
  missing = not_installed(args.impls)
  args.impls = [spec for spec in args.impls if parse_impl(spec)[0] not in missing]
  if args.fit:
    _write_json(args.out, "fit.json", run_fit(args))
    return
  start = time.perf_counter()
  rows = run_sweep(args, args.impls)
  timing = {
    "reps": args.reps,
    "rounds": args.rounds,
    "max_rounds": measure.max_rounds(args.rounds),
  }
  print(
    report.format_table(
      rows, not_installed=missing, timing=timing, accuracy=args.accuracy
    )
  )
  _write_json(args.out, "results.json", rows, not_installed=missing, timing=timing)
  if not any("time_ms" in row for row in rows):
    sys.exit("nothing was measured: every implementation failed (see above)")
  title_device = f"{device.device_kind}, jax {jax.__version__}"
  why_not = report.plot(rows, os.path.join(args.out, "bench.png"), title_device)
  print(
    f"wrote {args.out}/results.json"
    + (f"; no plot: {why_not}" if why_not else f" and {args.out}/bench.png")
    + f" ({time.perf_counter() - start:.0f} s)"
  )


def _write_json(out: str, name: str, rows: list[dict], **extra) -> None:
  device = jax.devices()[0]
  os.makedirs(out, exist_ok=True)
  with open(os.path.join(out, name), "w") as f:
    json.dump(
      {"device": device.device_kind, "jax": jax.__version__, "rows": rows, **extra},
      f,
      indent=1,
    )
