"""Measurements: time, extra memory and accuracy of a case's implementations.

With ``--isolate`` (the default on a GPU) a case takes ``1 + n`` fresh
processes (``python -m mst_jax.bench.measure REQUEST``) for ``n``
implementations, all sharing one persistent compilation cache:

- one timing process compiles every implementation (and autotunes its GEMMs),
  writing each executable to the cache, runs each once (loss, gradient error
  with ``--accuracy``) and times them in interleaved rounds. A step's time does
  not depend on what the process allocated before, so one process is honest
  for all of them, and interleaving spreads a slow spell of the host over
  every implementation instead of one.
- one memory process per implementation loads its executable from the cache
  (no compilation, no autotuning) and runs the step once. Peak memory only
  grows and jax cannot reset it, so this is the only way to get a peak that
  holds the step and nothing else. A cache miss (the step compiled in that
  process after all) is reported with the row.

With ``--first-call``, one more process per implementation compiles with an
empty cache of its own and runs once: its peak is what the step needs the
first time it runs, autotuning included (``first_call_extra_bytes``).

Extra memory is the peak minus the inputs and the gradients as the allocator
holds them (the bytes in use after the step, which it rounds up from their
sizes; ``extra_bytes_by_nbytes`` subtracts their sizes instead). On a CPU,
where ``memory_stats()`` has nothing, extra memory is the compiled program's
temporaries (``memory_analysis().temp_size_in_bytes``).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp

from mst_jax.bench import fit
from mst_jax.bench.cases import Case, Unsupported, make_inputs, make_loss, make_step

_RESULT_TAG = "MST_BENCH_RESULT "
_STAGE_TAG = "MST_BENCH_STAGE "
_START = time.perf_counter()
# Rounds agree when more than half of them are within this of their median.
ROUND_TOLERANCE = 0.1


def _stage(what: str) -> None:
  """Marks progress on stderr (shown when a process is killed for time).

  Only in a measuring process (this module run as ``__main__``).
  """
  if __name__ != "__main__":
    return
  print(
    f"{_STAGE_TAG}{time.perf_counter() - _START:.1f} s: {what}",
    file=sys.stderr,
    flush=True,
  )


def isolated_env(cache_dir: str) -> dict:
  """Environment of the measuring processes: no preallocation, and a shared
  persistent compilation cache in ``cache_dir`` (every executable cached)."""
  return {
    "XLA_PYTHON_CLIENT_PREALLOCATE": "false",
    "JAX_COMPILATION_CACHE_DIR": cache_dir,
    "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
    "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0",
  }


def _nbytes(tree, device) -> int:
  """Bytes of ``tree``'s shards on ``device``."""
  return sum(
    s.data.nbytes
    for x in jax.tree.leaves(tree)
    for s in x.addressable_shards
    if s.device == device
  )


def round_statistic(rounds: Sequence[Sequence[float]]) -> float:
  """The median over rounds of each round's fastest step.

  A slow spell of the host lengthens some steps, never shortens one: a
  round's minimum discards its slow steps, and the median over rounds
  discards a round that was slow throughout.
  """
  return statistics.median(min(r) for r in rounds)


def rounds_agree(rounds: Sequence[Sequence[float]], tolerance: float) -> bool:
  """More than half of the rounds' minimums within ``tolerance`` of their median."""
  middle = round_statistic(rounds)
  close = sum(abs(min(r) - middle) <= tolerance * middle for r in rounds)
  return 2 * close > len(rounds)


def max_rounds(rounds: int) -> int:
  """The most rounds ``time_impls`` runs when asked for at least ``rounds``."""
  return 2 * rounds + 1


def time_rounds(
  steps: dict[str, Callable[[], object]],
  reps: int,
  rounds: int,
  most_rounds: int,
  tolerance: float = ROUND_TOLERANCE,
  clock: Callable[[], float] = time.perf_counter,
) -> dict[str, list[list[float]]]:
  """Seconds of each synchronised step, per name and round.

  Every round runs each step ``reps`` times, name after name, so the
  names share the host's slow spells; each round starts one name later, so
  no name always runs first or after the same one (on a GPU at its power
  limit the order may matter). After ``rounds`` rounds it adds rounds (up to
  ``most_rounds``) while any name's rounds disagree (``rounds_agree``).
  """
  times = {name: [] for name in steps}
  names = list(steps)
  while True:
    start_at = len(times[names[0]]) % len(names)
    for name in names[start_at:] + names[:start_at]:
      step = steps[name]
      this_round = []
      for _ in range(reps):
        start = clock()
        jax.block_until_ready(step())
        this_round.append(clock() - start)
      times[name].append(this_round)
    done = len(next(iter(times.values())))
    agree = all(rounds_agree(t, tolerance) for t in times.values())
    if done >= most_rounds or (done >= rounds and agree):
      return times


def timing_summary(rounds: Sequence[Sequence[float]], flops: float) -> dict:
  """The row's time fields from per-round step seconds."""
  everything = [t for r in rounds for t in r]
  minimums = [min(r) for r in rounds]
  seconds = round_statistic(rounds)
  return {
    "time_ms": seconds * 1e3,
    "median_ms": statistics.median(everything) * 1e3,
    "min_ms": min(everything) * 1e3,
    "round_min_ms": [m * 1e3 for m in minimums],
    "spread": max(minimums) / min(minimums),
    "tflops": flops / seconds / 1e12,
  }


def _reference_grads(case: Case, inputs):
  """Gradients of the naive loss in float32 at HIGHEST matmul precision."""
  hidden, weight, labels, where, *teacher = inputs  # a teacher head: "distill"

  def reference(h, w):
    with jax.default_matmul_precision("highest"):
      return make_loss("naive", case)(h, w, labels, where, *teacher)

  return jax.jit(jax.grad(reference, argnums=case.argnums))(
    hidden.astype(jnp.float32), weight.astype(jnp.float32)
  )


def _relative_errors(grads, reference) -> dict:
  def rel(out, ref):
    out, ref = out.astype(jnp.float32), ref.astype(jnp.float32)
    return float(jnp.linalg.norm(out - ref) / jnp.linalg.norm(ref))

  names = ("dhidden_rel_err", "dweight_rel_err")
  return {n: rel(g, r) for n, g, r in zip(names, grads, reference, strict=False)}


def accuracy(spec: str, case: Case) -> dict:
  """Relative error of dhidden and dweight against float32 HIGHEST logits."""
  inputs = make_inputs(case)
  grads = make_step(spec, case)(*inputs)[1]
  return _relative_errors(grads, _reference_grads(case, inputs))


def time_impls(
  specs: Sequence[str],
  case: Case,
  reps: int,
  rounds: int,
  *,
  most_rounds: int | None = None,
  warmup_s: float = 0.0,
  with_accuracy: bool = False,
) -> list[dict]:
  """Compiles and runs each spec once, then times them in interleaved rounds.

  One row per spec; a spec that cannot run this case has ``skipped``, one
  that fails has ``error``. ``most_rounds`` defaults to ``max_rounds(rounds)``.
  """
  rows = [{"case": case.name, "impl": s, "tokens": case.tokens} for s in specs]
  try:
    _stage(f"making inputs ({case.tokens:,} tokens)")
    inputs = make_inputs(case)
    reference = _reference_grads(case, inputs) if with_accuracy else None
  except Unsupported as e:
    return [{**row, "skipped": str(e)} for row in rows]
  steps = {}
  for spec, row in zip(specs, rows, strict=True):
    try:
      _stage(f"compiling {spec}")
      compiled, result = _compile_and_run_once(spec, case, inputs, reference)
      row.update(result)
    except Unsupported as e:
      row["skipped"] = str(e)
      continue
    except Exception as e:  # noqa: BLE001 -- report the failure, time the rest
      row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
      continue
    steps[spec] = functools.partial(compiled, *inputs)
  end = time.perf_counter() + warmup_s
  while steps and time.perf_counter() < end:
    for step in steps.values():
      jax.block_until_ready(step())
  _stage("timing")
  most = max_rounds(rounds) if most_rounds is None else most_rounds
  times = time_rounds(steps, reps, rounds, most) if steps else {}
  for spec, row in zip(specs, rows, strict=True):
    if spec in times:
      row.update(timing_summary(times[spec], case.flops), reps=reps)
  return rows


def _compile_and_run_once(spec: str, case: Case, inputs, reference):
  """``(compiled step, row fields)``: compile time, temporaries, loss, errors."""
  step = make_step(spec, case)
  start = time.perf_counter()
  compiled = step.lower(*inputs).compile()
  result = {"compile_s": time.perf_counter() - start}
  result["temp_bytes"] = compiled.memory_analysis().temp_size_in_bytes
  loss, grads = compiled(*inputs)
  result["loss"] = float(loss)
  if reference is not None:
    result.update(_relative_errors(grads, reference))
  if jax.devices()[0].memory_stats() is None:  # a CPU: the compiled temporaries
    result.update(extra_bytes=result["temp_bytes"], extra_method="compiled temp")
  return compiled, result


def load_step(spec: str, case: Case, inputs):
  """``(compiled step, seconds, whether it came from the compilation cache)``."""
  hits = []
  listener = lambda event, **_: hits.append(event.endswith("/cache_hits"))
  jax.monitoring.register_event_listener(listener)
  try:
    start = time.perf_counter()
    compiled = make_step(spec, case).lower(*inputs).compile()
    seconds = time.perf_counter() - start
  finally:
    jax.monitoring.unregister_event_listener(listener)
  return compiled, seconds, any(hits)


def peak_extra_bytes(spec: str, case: Case) -> dict:
  """Runs the step once; peak bytes in use minus inputs and gradients.

  The step should come from the persistent cache (``compiled_here`` False):
  compiling here would put GEMM autotuning's scratch buffers into the peak.
  For a case over several devices, per device (each device's peak minus its
  own shards); ``extra_bytes`` is then the largest of them.
  """
  devices = jax.devices()[: case.devices]
  if devices[0].memory_stats() is None:
    raise Unsupported("peak memory needs memory_stats() (a GPU)")
  before = [d.memory_stats()["bytes_in_use"] for d in devices]
  _stage(f"making inputs ({case.tokens:,} tokens)")
  inputs = jax.block_until_ready(make_inputs(case))
  _stage("loading the step")
  compiled, load_s, from_cache = load_step(spec, case, inputs)
  _stage("stepping")
  loss, grads = compiled(*inputs)
  jax.block_until_ready(grads)
  _stage("stepped")
  after = [d.memory_stats() for d in devices]
  # What the allocator holds for the inputs and gradients is more than their
  # bytes: it rounds large buffers up (the Llama-3 head's 1002 MiB weight and
  # dweight take 1024 MiB each). Those bytes are in use after the step too, so
  # the peak minus what is in use after the step (inputs and gradients alive)
  # is what the step needed beyond them.
  extra = [s["peak_bytes_in_use"] - s["bytes_in_use"] for s in after]
  by_nbytes = [
    s["peak_bytes_in_use"] - b - _nbytes((inputs, grads, loss), d)
    for d, b, s in zip(devices, before, after, strict=True)
  ]
  result = {
    "extra_bytes": max(extra),
    "extra_bytes_by_nbytes": max(by_nbytes),
    "extra_method": "peak memory_stats minus bytes in use after the step",
    "compiled_here": not from_cache,
    "load_s": load_s,
  }
  if case.devices > 1:
    result["extra_bytes_per_device"] = extra
  return result


def first_call_extra_bytes(spec: str, case: Case) -> dict:
  """Peak bytes in use minus those in use after the first step, compiling here.

  The peak includes compilation (GEMM autotuning's scratch buffers): what a
  step needs the first time it runs. Run with an empty compilation cache.
  """
  inputs = make_inputs(case)
  loss, grads = make_step(spec, case)(*inputs)
  jax.block_until_ready((loss, grads))
  stats = [d.memory_stats() for d in jax.devices()[: case.devices]]
  if any(s is None for s in stats):
    raise Unsupported("the first call's peak needs memory_stats() (a GPU)")
  extra = max(s["peak_bytes_in_use"] - s["bytes_in_use"] for s in stats)
  return {"first_call_extra_bytes": extra}


def run_here(
  spec: str | Sequence[str],
  case: Case,
  what: str,
  reps: int = 10,
  granularity: int = 8192,
  rounds: int = 3,
) -> dict:
  """One measurement in this process.

  ``what``: "time" (``spec`` may be a list: ``{"rows": [...]}``, see
  ``time_impls``; add "+accuracy" for gradient errors), "memory",
  "first_call", "accuracy", or "fit" (the largest N, a multiple of
  ``granularity``, whose compiled step fits the device: ``bench.fit``).
  """
  if what.startswith("time"):
    specs = [spec] if isinstance(spec, str) else list(spec)
    warmup_s = 1.0 if jax.default_backend() == "gpu" else 0.0
    rows = time_impls(
      specs,
      case,
      reps,
      rounds,
      warmup_s=warmup_s,
      with_accuracy=what == "time+accuracy",
    )
    return rows[0] if isinstance(spec, str) else {"rows": rows}
  result = {"case": case.name, "impl": spec, "tokens": case.tokens, "what": what}
  try:
    if what == "fit":
      stats = jax.devices()[0].memory_stats()
      if stats is None:
        raise Unsupported("--fit needs a device that reports memory_stats() (a GPU)")
      capacity = stats["bytes_limit"]
      log = []
      tokens = fit.largest_tokens(spec, case, capacity, granularity, log.append)
      result.update(footprint_tokens=tokens, capacity=capacity, log=log)
    elif what == "memory":
      result.update(peak_extra_bytes(spec, case))
    elif what == "first_call":
      result.update(first_call_extra_bytes(spec, case))
    elif what == "accuracy":
      result.update(accuracy(spec, case))
    else:
      raise ValueError(what)
  except Unsupported as e:
    result["skipped"] = str(e)
  return result


def run_isolated(
  spec: str | Sequence[str],
  case: Case,
  what: str,
  reps: int,
  env: dict,
  granularity: int = 8192,
  timeout: float | None = None,
  rounds: int = 3,
) -> dict:
  """``run_here`` in a fresh process (see the module docstring).

  ``timeout``: seconds before the process is killed; the result then has an
  ``error`` with the stages it reached (``_stage`` lines on its stderr).
  """
  payload = json.dumps(
    {
      "case": dataclasses.asdict(case),
      "impl": spec,
      "what": what,
      "reps": reps,
      "granularity": granularity,
      "rounds": rounds,
    }
  )
  failed = {"case": case.name, "impl": spec, "tokens": case.tokens, "what": what}
  try:
    proc = subprocess.run(
      [sys.executable, "-m", "mst_jax.bench.measure", payload],
      capture_output=True,
      text=True,
      env={**os.environ, **env},
      check=False,
      timeout=timeout,
    )
  except subprocess.TimeoutExpired as e:
    stderr = e.stderr.decode() if isinstance(e.stderr, bytes) else e.stderr or ""
    stages = [x for x in stderr.splitlines() if x.startswith(_STAGE_TAG)]
    reached = " | ".join(stages[-3:])
    return {**failed, "error": f"timed out after {timeout:.0f} s; {reached}"}
  for line in proc.stdout.splitlines():
    if line.startswith(_RESULT_TAG):
      return json.loads(line[len(_RESULT_TAG) :])
  tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
  return {**failed, "error": f"exit {proc.returncode}: " + " | ".join(tail)}


def main(argv=None) -> None:
  request = json.loads((argv or sys.argv[1:])[0])
  case = Case(**request["case"])
  result = run_here(
    request["impl"],
    case,
    request["what"],
    request["reps"],
    request["granularity"],
    request["rounds"],
  )
  print(_RESULT_TAG + json.dumps(result, default=float), flush=True)


if __name__ == "__main__":
  main()
