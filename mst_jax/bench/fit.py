"""How large a problem fits: bisection over compiled memory footprints.

A program fits when XLA's own accounting of the compiled step (arguments +
outputs + temporaries - donated aliases, ``memory_analysis()``) is at most the
device's allocator limit (``memory_stats()["bytes_limit"]``; raise it with
``XLA_PYTHON_CLIENT_MEM_FRACTION=0.95``). Compiling can itself run out of
memory (GEMM autotuning allocates the operands it times): that counts as not
fitting, and ``--fit`` bisects with autotuning off. It then confirms with real
steps, autotuned (untuned GEMMs made the Llama-3 head step 29x slower).
"""

from __future__ import annotations

from collections.abc import Callable

import jax

from mst_jax.bench.cases import Case, input_shapes, make_step

_OUT_OF_MEMORY = ("RESOURCE_EXHAUSTED", "Out of memory", "out of memory")


def compiled_footprint(lowered: Callable[[], jax.stages.Lowered]) -> float:
  """Bytes the compiled program needs on the device (inf: it did not compile)."""
  try:
    analysis = lowered().compile().memory_analysis()
  except jax.errors.JaxRuntimeError as e:
    if not any(text in str(e) for text in _OUT_OF_MEMORY):
      raise
    return float("inf")
  return (
    analysis.argument_size_in_bytes
    + analysis.output_size_in_bytes
    + analysis.temp_size_in_bytes
    - analysis.alias_size_in_bytes
  )


def largest_fitting(
  fits: Callable[[int], bool],
  low: int,
  high: int,
  granularity: int,
  log: Callable[[str], None] = print,
) -> int:
  """The largest multiple of ``granularity`` in ``[low, high]`` that fits (0: none).

  Doubles from ``low`` to bracket the boundary before bisecting, so it never
  compiles a size far past the boundary (compiling a program much too large
  can take minutes: GEMM autotuning retries allocations it cannot get).
  """
  if not fits(low):
    return 0

  def probe(n: int) -> bool:
    ok = fits(n)
    log(f"{n:,}: {'fits' if ok else 'does not fit'}")
    return ok

  while low < high:
    step = min(2 * low, high)
    if not probe(step):
      high = step
      break
    low = step
  else:
    return low
  while high - low > granularity:
    mid = (low + high) // 2 // granularity * granularity
    low, high = (mid, high) if probe(mid) else (low, mid)
  return low


def step_footprint(spec: str, case: Case) -> float:
  """Compiled footprint of ``spec``'s value-and-grad on ``case``."""
  step = make_step(spec, case)
  return compiled_footprint(lambda: step.lower(*input_shapes(case)))


def largest_tokens(
  spec: str, case: Case, capacity: int, granularity: int, log=print
) -> int:
  """The largest N (a multiple of ``granularity``) whose step fits ``capacity``."""
  fits = lambda n: step_footprint(spec, case.with_tokens(n)) <= capacity
  return largest_fitting(fits, granularity, 2**26, granularity, log)


def confirm_by_running(
  runs: Callable[[int], bool],
  start: int,
  granularity: int,
  attempts: int,
  log: Callable[[str], None] = print,
  ran: int = 0,
) -> tuple[int, int | None]:
  """``(largest N that ran, smallest that did not)`` from real steps.

  Starts at ``start`` (the footprint's N), halves until a step runs (or, given
  ``ran``, an N known to run, bisects towards it at once), then bisects
  between the largest that ran and the smallest that did not, within
  ``attempts`` real steps (each allocates the inputs: expensive).
  """
  failed, n = None, start
  for _ in range(attempts):
    if n <= ran or (failed is not None and n >= failed):
      break
    ok = runs(n)
    log(f"{n:,}: {'runs' if ok else 'fails to run'}")
    ran, failed = (n, failed) if ok else (ran, n)
    if failed is None or failed - ran <= granularity:
      break
    if ran:
      n = (ran + failed) // 2 // granularity * granularity
    else:
      n = max(granularity, n // 2 // granularity * granularity)
  return ran, failed
