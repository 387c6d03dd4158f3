"""How a step's cost grows with N: make inputs, compile, two steps (GPU).

  python tools/step_scaling.py [--case llama] [--spec mst_jax] N [N ...]

For each N (one process, in order, the previous inputs freed first) prints
the seconds spent making the inputs, compiling, on the first step and on a
second step, and the peak bytes in use. A step whose time grows faster than
N (a whole ``[N, D]`` copy per group, say) shows up as a rising time per
1000 tokens; stops at the first N that does not fit.
"""

import argparse
import itertools
import time

import jax

from mst_jax.bench.cases import CASES, make_inputs, make_step

GiB = 2**30


def main() -> None:
  parser = argparse.ArgumentParser()
  parser.add_argument("tokens", type=int, nargs="+")
  parser.add_argument("--case", default="llama")
  parser.add_argument("--spec", default="mst_jax")
  args = parser.parse_args()
  device = jax.devices()[0]
  print(f"jax {jax.__version__} on {device.device_kind}; {args.spec} on {args.case}")
  for n in args.tokens:
    case = CASES[args.case].with_tokens(n)
    times = [time.perf_counter()]
    try:
      inputs = jax.block_until_ready(make_inputs(case))
      times.append(time.perf_counter())
      compiled = make_step(args.spec, case).lower(*inputs).compile()
      times.append(time.perf_counter())
      for _ in range(2):
        jax.block_until_ready(compiled(*inputs))
        times.append(time.perf_counter())
    except jax.errors.JaxRuntimeError as e:
      print(f"{n:,}: failed after {time.perf_counter() - times[0]:.1f} s: {e}"[:400])
      break
    steps = (b - a for a, b in itertools.pairwise(times))
    inputs_s, compile_s, first_s, second_s = steps
    stats = device.memory_stats() or {}
    peak = stats.get("peak_bytes_in_use", 0) / GiB
    print(
      f"{n:>10,}: inputs {inputs_s:6.2f} s  compile {compile_s:6.2f} s  "
      f"step {first_s:7.3f} s, {second_s:7.3f} s "
      f"({second_s / n * 1e6:.3f} ms per 1000 tokens)  peak {peak:.1f} GiB",
      flush=True,
    )
    del inputs, compiled


if __name__ == "__main__":
  main()
