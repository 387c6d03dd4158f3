"""Where a step's time goes: device kernels, summed by name, per step.

Traces ``--steps`` value-and-grad steps of each ``CASE@SPEC`` (a case of
``mst_jax.bench`` and an implementation spec, e.g. ``llama@mst_jax`` or
``gemma@mst_jax:impl=mosaic``) after a warm-up, with ``jax.profiler``, and
sums the duration of every device kernel by name:

  python tools/profile_step.py llama@naive_cast llama@mst_jax --out prof

prints each case's kernels, largest first, and how busy the device was: the
span from the first kernel's start to the last one's end, the time inside
it when no kernel ran, and the longest of those idle gaps with the kernels
on either side (a host round trip mid-step shows there). It writes
``profiles.json`` (kernel milliseconds per step, the idle time) under
``--out``. docs/benchmarks.md's kernel-time figures come from it.
On a CPU the trace has no device kernels and the summary is empty.
"""

from __future__ import annotations

import argparse
import collections
import glob
import gzip
import json
import os
import tempfile

import jax

from mst_jax.bench.cases import CASES, make_inputs, make_step


def device_kernels(trace_path: str) -> list[dict]:
  """The device kernel events of a perfetto trace (host events left out)."""
  with gzip.open(trace_path) as f:
    events = json.load(f)["traceEvents"]
  devices = {
    e["pid"]
    for e in events
    if e.get("ph") == "M"
    and e.get("name") == "process_name"
    and "/device:" in e["args"]["name"]
  }
  return [e for e in events if e.get("ph") == "X" and e.get("pid") in devices]


def kernel_times(trace_path: str, steps: int) -> dict[str, float]:
  """Milliseconds per step of each device kernel in a perfetto trace."""
  totals = collections.defaultdict(float)
  for e in device_kernels(trace_path):
    totals[e["name"]] += e["dur"] / 1e3 / steps
  return dict(sorted(totals.items(), key=lambda item: -item[1]))


def idle_time(trace_path: str, steps: int, top: int = 5) -> dict:
  """How busy the device was between its first kernel's start and its last
  one's end: milliseconds per step of that span and of the time in it when
  no kernel ran (on any stream), and the ``top`` longest idle gaps
  (microseconds, the kernels before and after)."""
  kernels = sorted(
    (e["ts"], e["ts"] + e["dur"], e["name"]) for e in device_kernels(trace_path)
  )
  if not kernels:
    return {"span_ms": 0.0, "idle_ms": 0.0, "gaps": []}
  gaps, end, last = [], kernels[0][1], kernels[0][2]
  for start, stop, name in kernels[1:]:
    if start > end:
      gaps.append((start - end, last, name))
    if stop > end:
      end, last = stop, name
  gaps.sort(reverse=True)
  return {
    "span_ms": (end - kernels[0][0]) / 1e3 / steps,
    "idle_ms": sum(g for g, _, _ in gaps) / 1e3 / steps,
    "gaps": [(round(g, 1), before, after) for g, before, after in gaps[:top]],
  }


def profile(case_name: str, spec: str, steps: int, warm_up: int = 3) -> dict:
  """Compiles and warms one step, then traces ``steps`` of them."""
  case = CASES[case_name]
  inputs = make_inputs(case)
  step = make_step(spec, case)
  for _ in range(1 + warm_up):
    jax.block_until_ready(step(*inputs))
  with tempfile.TemporaryDirectory() as log_dir:
    with jax.profiler.trace(log_dir, create_perfetto_trace=True):
      for _ in range(steps):
        result = step(*inputs)
      jax.block_until_ready(result)
    (trace,) = glob.glob(f"{log_dir}/**/perfetto_trace.json.gz", recursive=True)
    kernels = kernel_times(trace, steps)
    idle = idle_time(trace, steps)
  return {"kernel_ms_per_step": sum(kernels.values()), "kernels": kernels, **idle}


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("runs", nargs="+", help="CASE@SPEC, e.g. llama@mst_jax")
  parser.add_argument("--steps", type=int, default=3)
  parser.add_argument("--top", type=int, default=12, help="kernels printed per run")
  parser.add_argument("--out", default="profile_out")
  args = parser.parse_args()
  results = {}
  for run in args.runs:
    case_name, _, spec = run.partition("@")
    result = profile(case_name, spec or "mst_jax", args.steps)
    results[run] = result
    print(
      f"{run}: {result['kernel_ms_per_step']:.2f} ms of kernels per step; the"
      f" device idle {result['idle_ms']:.3f} of the {result['span_ms']:.2f} ms"
      " from its first kernel to its last"
    )
    for gap_us, before, after in result["gaps"]:
      print(f"  idle {gap_us:8.1f} us  after {before[:40]}, before {after[:40]}")
    for name, ms in list(result["kernels"].items())[: args.top]:
      print(f"  {ms:8.3f} ms  {name[:90]}")
  os.makedirs(args.out, exist_ok=True)
  with open(os.path.join(args.out, "profiles.json"), "w") as f:
    json.dump({"jax": jax.__version__, "device": str(jax.devices()[0]), **results}, f)


if __name__ == "__main__":
  main()
