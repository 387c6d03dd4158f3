"""``python -m mst_jax.bench``: sweep cases x implementations, report, plot.

Each row is ``jax.value_and_grad`` of the mean loss with respect to hidden and
weight (hidden only for a frozen head) under ``jax.jit``. The naive baseline
(full float32 logits, ``logsumexp`` minus the target logit, masked mean) is
measured in the same run, and ratios are against it. Writes ``results.json``
and ``bench.png`` (time and extra memory against tokens) under ``--out``.

Implementations are specs: ``naive``, ``naive_cast``, ``mst_jax`` (options
after a colon, e.g. ``mst_jax:grad_mode=recompute,chunk_size=1024``), and the
peers ``jax_cce`` and ``tokamax`` when installed.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from collections.abc import Sequence

import jax

from mst_jax.bench import fit, kernels, measure
from mst_jax.bench.cases import CASES

GPU_CASES = [
  "llama",
  "gemma",
  "llama_32k",
  "llama_sft_prefix",
  "llama_sft_random",
  "llama_frozen",
]
DEFAULT_IMPLS = ["naive", "naive_cast", "mst_jax", "jax_cce", "tokamax"]


def _progress(items, desc):
  try:
    from tqdm import tqdm
  except ImportError:
    return items
  return tqdm(items, desc=desc, unit="run", leave=False)


def run_sweep(args: argparse.Namespace) -> list[dict]:
  """Measures every (case, tokens, impl); returns the result rows."""
  cases = []
  for name in args.cases:
    base = CASES[name]
    cases += [base.with_tokens(n) for n in args.tokens] if args.tokens else [base]
  work = [(case, impl) for case in cases for impl in args.impls]
  rows = []
  for case, impl in _progress(work, "bench"):
    # A cache per run: its processes share the executable, and no run inherits
    # another's GEMM autotuning (which would hide the first call's peak).
    with tempfile.TemporaryDirectory(prefix="mst_jax_bench_cache_") as cache:
      row = _measure(args, case, impl, measure.isolated_env(cache))
    row["description"] = case.description
    rows.append(row)
  _add_ratios(rows)
  return rows


def _measure(args: argparse.Namespace, case, impl: str, env: dict) -> dict:
  """One (case, impl) row: time, and memory and accuracy where asked for."""
  if not args.isolate:
    row = measure.run_here(impl, case, "time", args.reps)
    # One process measures every run: its lifetime peak is not this run's.
    row.pop("first_call_extra_bytes", None)
    if args.accuracy and "median_ms" in row:
      accuracy = measure.run_here(impl, case, "accuracy")
      row.update({k: v for k, v in accuracy.items() if "err" in k})
    return row
  row = measure.run_isolated(impl, case, "time", args.reps, env)
  if "median_ms" in row and args.memory:
    memory = measure.run_isolated(impl, case, "memory", 0, env)
    row.update({k: v for k, v in memory.items() if k not in row or k == "error"})
  if args.accuracy and "median_ms" in row:
    accuracy = measure.run_isolated(impl, case, "accuracy", args.reps, env)
    row.update({k: v for k, v in accuracy.items() if "err" in k})
  return row


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
      if r["case"] == row["case"] and r["impl"].startswith("naive") and "median_ms" in r
    ]
    if not naive or "median_ms" not in row:
      continue
    base = min(naive, key=lambda r: r["median_ms"])
    row["time_x"] = row["median_ms"] / base["median_ms"]
    if row.get("extra_bytes") is not None and base.get("extra_bytes"):
      row["mem_x"] = row["extra_bytes"] / base["extra_bytes"]


def format_table(rows: Sequence[dict]) -> str:
  header = (
    f"{'case':<22} {'impl':<34} {'median ms':>9} {'min ms':>8} {'extra MiB':>9}"
    f" {'1st MiB':>8} {'TFLOP/s':>7} {'time x':>6} {'mem x':>6} {'dh err':>8}"
    f" {'dw err':>8}"
  )
  lines = [header, "-" * len(header)]
  fmt = lambda row, key, spec: format(row[key], spec) if key in row else "-"
  mib = lambda row, key: row[key] / 2**20 if row.get(key) is not None else float("nan")
  for r in rows:
    impl = r["impl"][:34]
    if "median_ms" not in r:
      reason = r.get("skipped") or r.get("error", "?")
      lines.append(f"{r['case']:<22} {impl:<34} skipped: {reason[:60]}")
      continue
    lines.append(
      f"{r['case']:<22} {impl:<34} {r['median_ms']:>9.2f} {r['min_ms']:>8.2f}"
      f" {mib(r, 'extra_bytes'):>9.0f} {mib(r, 'first_call_extra_bytes'):>8.0f}"
      f" {r['tflops']:>7.1f} {fmt(r, 'time_x', '6.2f'):>6} {fmt(r, 'mem_x', '6.3f'):>6}"
      f" {fmt(r, 'dhidden_rel_err', '8.1e'):>8} {fmt(r, 'dweight_rel_err', '8.1e'):>8}"
    )
  return "\n".join(lines)


def plot(rows: Sequence[dict], path: str, title: str | None = None) -> str | None:
  """Time and extra memory against tokens, log scale; returns why not, or None."""
  try:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
  except ImportError:
    return "matplotlib is not installed (pip install 'mst_jax[bench]')"
  fig, (ax_time, ax_mem) = plt.subplots(1, 2, figsize=(11, 4.2))
  series = {}
  for r in rows:
    if "median_ms" in r:
      key = (r["case"].split("@")[0], r["impl"])
      series.setdefault(key, []).append(r)
  for (case, impl), points in sorted(series.items()):
    points.sort(key=lambda r: r["tokens"])
    tokens = [r["tokens"] for r in points]
    label = f"{impl} ({case})"
    ax_time.plot(tokens, [r["median_ms"] for r in points], "o-", label=label)
    if all(r.get("extra_bytes") is not None for r in points):
      gib = [max(r["extra_bytes"], 1) / 2**30 for r in points]
      ax_mem.plot(tokens, gib, "o-", label=label)
  for ax, ylabel in (
    (ax_time, "median step time (ms)"),
    (ax_mem, "extra memory (GiB)"),
  ):
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("tokens N")
    ax.set_ylabel(ylabel)
    ax.grid(True, which="both", alpha=0.3)
  ax_time.legend(fontsize=7)
  device = jax.devices()[0]
  default = f"value_and_grad of the LM-head loss, {device.device_kind}"
  fig.suptitle(title or f"{default}, jax {jax.__version__}")
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  return None


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
  on_gpu = jax.default_backend() == "gpu"
  parser = argparse.ArgumentParser(
    prog="python -m mst_jax.bench",
    description=__doc__,
    formatter_class=argparse.RawDescriptionHelpFormatter,
  )
  parser.add_argument(
    "--cases",
    nargs="+",
    choices=sorted(CASES),
    default=GPU_CASES if on_gpu else ["cpu"],
    help="named problem shapes (default: the GPU benchmark cases, or 'cpu' on a CPU)",
  )
  parser.add_argument(
    "--tokens",
    nargs="+",
    type=int,
    default=None if on_gpu else [512, 1024, 2048],
    help="sweep N over these values for every case (default on a CPU: 512 1024 2048)",
  )
  parser.add_argument(
    "--impls", nargs="+", default=DEFAULT_IMPLS, help="implementation specs"
  )
  parser.add_argument("--reps", type=int, default=10, help="timed repetitions")
  parser.add_argument(
    "--isolate",
    action=argparse.BooleanOptionalAction,
    default=on_gpu,
    help="measure each run in fresh processes (default on a GPU)",
  )
  parser.add_argument(
    "--memory",
    action=argparse.BooleanOptionalAction,
    default=on_gpu,
    help="peak-memory pass (needs --isolate; default on a GPU)",
  )
  parser.add_argument(
    "--accuracy", action="store_true", help="also measure gradient error"
  )
  parser.add_argument("--out", default="bench_out", help="directory for JSON and plot")
  parser.add_argument(
    "--kernels",
    action="store_true",
    help="time the kernels alone: the CE kernels and the head GEMMs",
  )
  parser.add_argument(
    "--kernel-groups",
    nargs="+",
    choices=["ce", "gemm"],
    default=["ce", "gemm"],
    help="with --kernels: the CE kernels, the head GEMMs (XLA vs Mosaic GPU)",
  )
  parser.add_argument(
    "--gemm-heads",
    nargs="+",
    choices=sorted(kernels.GEMM_HEADS),
    default=["llama", "gemma"],
    help="with --kernels: head shapes for the GEMMs (N, D, V)",
  )
  parser.add_argument(
    "--gemm-layouts", nargs="+", choices=["vd", "dv"], default=["vd", "dv"]
  )
  parser.add_argument(
    "--gemm-products",
    nargs="+",
    choices=["logits", "dhidden", "dweight"],
    default=["logits", "dhidden", "dweight"],
  )
  parser.add_argument(
    "--gemm-configs",
    nargs="*",
    default=[],
    help="with --kernels: extra Mosaic GemmConfigs to time, e.g. tile_n=192,stages=3",
  )
  parser.add_argument(
    "--chunk-shapes",
    nargs="+",
    default=["1024x128256", "4096x128256", "1024x256000", "4096x256000"],
    help="with --kernels: chunk shapes ROWSxV",
  )
  parser.add_argument(
    "--blocks",
    nargs="+",
    default=["1x2048x4"],
    help="with --kernels: Pallas KernelBlocks ROWSxBLOCK_VxWARPS[xSTAGES]",
  )
  parser.add_argument(
    "--fit",
    action="store_true",
    help="bisect the largest N that fits per case and impl (GPU)",
  )
  parser.add_argument(
    "--fit-granularity", type=int, default=8192, help="with --fit: N's step"
  )
  parser.add_argument(
    "--fit-confirm-attempts",
    type=int,
    default=6,
    help="with --fit: real steps tried (halving from the footprint N, then bisecting)",
  )
  parser.add_argument(
    "--fit-attempt-timeout",
    type=float,
    default=300,
    help="with --fit: seconds before a real step's process is killed (a failure)",
  )
  parser.add_argument(
    "--fit-from",
    type=int,
    default=None,
    help="with --fit: skip the compile-only bisection and confirm from this N",
  )
  parser.add_argument(
    "--fit-ran",
    type=int,
    default=0,
    help="with --fit: an N known to run (a failure then bisects towards it)",
  )
  parser.add_argument("--seed", type=int, default=0)
  args = parser.parse_args(argv)
  if args.fit_from and args.fit_ran >= args.fit_from:
    parser.error(f"--fit-ran {args.fit_ran} must be below --fit-from {args.fit_from}")
  return args


def main(argv: Sequence[str] | None = None) -> None:
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
      os.makedirs(args.out, exist_ok=True)
      with open(os.path.join(args.out, "gemms.json"), "w") as f:
        json.dump(
          {"device": device.device_kind, "jax": jax.__version__, "rows": rows}, f
        )
    return
  if args.fit:
    rows = run_fit(args)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "fit.json"), "w") as f:
      json.dump({"device": device.device_kind, "jax": jax.__version__, "rows": rows}, f)
    return
  args.memory = args.memory and args.isolate
  rows = run_sweep(args)
  print(format_table(rows))
  os.makedirs(args.out, exist_ok=True)
  with open(os.path.join(args.out, "results.json"), "w") as f:
    json.dump(
      {"device": device.device_kind, "jax": jax.__version__, "rows": rows}, f, indent=1
    )
  why_not = plot(rows, os.path.join(args.out, "bench.png"))
  print(
    f"wrote {args.out}/results.json"
    + (f"; no plot: {why_not}" if why_not else f" and {args.out}/bench.png")
  )
