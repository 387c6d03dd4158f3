"""The first call's peak memory, the step compiled after or before its inputs.

GEMM autotuning runs when a step is compiled and allocates scratch buffers the
size of the GEMMs' operands and outputs (for an LM head, weight-sized ones).
Compiled ahead of time from shapes alone (``step.lower(*shapes).compile()``),
before the inputs (in training: the parameters and optimizer state) are
allocated, that scratch no longer adds to them. Run once per setting, each in a
fresh process without a persistent compilation cache:

  python scripts/first_call_peak.py SPEC CASE {inputs_first|compile_first}

prints one JSON line: the process's peak minus the bytes in use after the
first step (inputs, loss and gradients alive), as ``mst_jax.bench`` counts
extra memory.
"""

from __future__ import annotations

import json
import sys

import jax

from mst_jax.bench.cases import CASES, input_shapes, make_inputs, make_step


def main() -> None:
  spec, case_name, order = sys.argv[1:4]
  case = CASES[case_name]
  step = make_step(spec, case)
  if order == "compile_first":
    compiled = step.lower(*input_shapes(case)).compile()
    inputs = jax.block_until_ready(make_inputs(case))
  elif order == "inputs_first":
    inputs = jax.block_until_ready(make_inputs(case))
    compiled = step.lower(*inputs).compile()
  else:
    raise SystemExit(f"order must be inputs_first or compile_first, got {order!r}")
  outputs = jax.block_until_ready(compiled(*inputs))
  stats = [d.memory_stats() for d in jax.devices()[: case.devices]]
  if any(s is None for s in stats):
    raise SystemExit("needs a device that reports memory_stats() (a GPU)")
  extra = max(s["peak_bytes_in_use"] - s["bytes_in_use"] for s in stats)
  print(
    json.dumps(
      {
        "spec": spec,
        "case": case_name,
        "order": order,
        "first_call_extra_mib": extra / 2**20,
      }
    )
  )
  del outputs


if __name__ == "__main__":
  main()
