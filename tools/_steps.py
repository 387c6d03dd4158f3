"""What the step scripts (``bias_step.py``, ``distill_dtypes.py``) share:
compile each step, time them in ``mst_jax.bench``'s rounds (the median over
rounds of each round's fastest step), print a row per step and write the
rows as JSON."""

from __future__ import annotations

import json

import jax

from mst_jax.bench.measure import max_rounds, round_statistic, time_rounds


def measure(case: str, steps: dict, reps: int, rounds: int, out: str | None) -> list:
  """Times ``steps`` (name -> ``(jitted step, args)``); returns the rows
  (case, impl, MiB of compiled temporaries, ms) after printing them and, with
  ``out``, writing them there."""
  calls, rows = {}, []
  for name, (step, args) in steps.items():
    compiled = step.lower(*args).compile()
    temp = getattr(compiled.memory_analysis(), "temp_size_in_bytes", 0) / 2**20
    jax.block_until_ready(compiled(*args))
    calls[name] = lambda compiled=compiled, args=args: compiled(*args)
    rows.append({"case": case, "impl": name, "temp_mib": round(temp, 1)})
  times = time_rounds(calls, reps, rounds, max_rounds(rounds))
  for row in rows:
    row["ms"] = round(1e3 * round_statistic(times[row["impl"]]), 3)
    print(f"{row['case']:14s} {row['impl']:40s} {row['ms']:9.3f} ms", end=" ")
    print(f"{row['temp_mib']:9.1f} MiB")
  if out:
    with open(out, "w") as f:
      device = str(jax.devices()[0])
      json.dump({"jax": jax.__version__, "device": device, "rows": rows}, f)
  return rows
