"""Seconds to lower and compile a benchmark case's step, each spec in a fresh
process without JAX's compilation cache, from shapes (nothing allocated):

  python tools/compile_time.py llama naive_cast mst_jax [--cases gemma llama_32k]

Prints one JSON line per (case, spec): ``lower_s``, ``compile_s``, ``total_s``,
the Mosaic GPU custom calls in the lowered program and the compiled
temporaries (MiB). Specs and cases are ``python -m mst_jax.bench``'s.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time


def measure(case_name: str, spec: str) -> dict:
  """One (case, spec) in this process."""
  import jax

  jax.config.update("jax_enable_compilation_cache", False)
  from mst_jax.bench import cases

  case = cases.CASES[case_name]
  step = cases.make_step(spec, case)
  start = time.perf_counter()
  lowered = step.lower(*cases.input_shapes(case))
  lowered_at = time.perf_counter()
  compiled = lowered.compile()
  done = time.perf_counter()
  return dict(
    case=case_name,
    spec=spec,
    jax=jax.__version__,
    device=jax.devices()[0].device_kind,
    lower_s=round(lowered_at - start, 2),
    compile_s=round(done - lowered_at, 2),
    total_s=round(done - start, 2),
    mosaic_calls=lowered.as_text().count("custom_call @mosaic_gpu"),
    temp_mib=compiled.memory_analysis().temp_size_in_bytes >> 20,
  )


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("case")
  parser.add_argument("specs", nargs="+")
  parser.add_argument("--cases", nargs="*", default=[], help="more cases")
  parser.add_argument("--one", action="store_true", help=argparse.SUPPRESS)
  args = parser.parse_args()
  if args.one:
    print(json.dumps(measure(args.case, args.specs[0])), flush=True)
    return
  for case in [args.case, *args.cases]:
    for spec in args.specs:
      cmd = [sys.executable, __file__, "--one", case, spec]
      run = subprocess.run(cmd, capture_output=True, text=True, check=False)
      lines = run.stdout.strip().splitlines()
      if run.returncode or not lines:
        print(json.dumps(dict(case=case, spec=spec, error=run.stderr[-500:])))
      else:
        print(lines[-1], flush=True)


if __name__ == "__main__":
  main()
