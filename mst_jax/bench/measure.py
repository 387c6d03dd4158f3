"""One measurement: time, extra memory and accuracy of one case and impl.

On a GPU every measurement runs in two fresh processes (``python -m
mst_jax.bench.measure SPEC``): the first compiles and times and leaves the
executable in a persistent compilation cache; the second loads it from there
and runs the step once, so the peak of ``memory_stats()`` holds the step and
nothing of compilation (GEMM autotuning allocates scratch buffers). The first
process reports its own peak after the first step too
(``first_call_extra_bytes``): what the step needs the first time it runs
(each run has its own cache, so no run reuses another's autotuning). Extra
memory is that peak minus the inputs and the gradients as the allocator holds
them (the bytes in use after the step, which it rounds up from their sizes;
``extra_bytes_by_nbytes`` subtracts their sizes instead). On a CPU, where
``memory_stats()`` has nothing, extra memory is the compiled program's
temporaries (``memory_analysis().temp_size_in_bytes``).
"""

from __future__ import annotations

import dataclasses
import json
import os
import statistics
import subprocess
import sys
import time

import jax
import jax.numpy as jnp

from mst_jax.bench import fit
from mst_jax.bench.cases import Case, Unsupported, make_inputs, make_loss, make_step

_RESULT_TAG = "MST_BENCH_RESULT "
_STAGE_TAG = "MST_BENCH_STAGE "
_START = time.perf_counter()


def _stage(what: str) -> None:
  """Marks progress on stderr (shown when a process is killed for time)."""
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


def time_step(spec: str, case: Case, reps: int, warmup_s: float) -> dict:
  """Compiles, warms up (clocks), then times ``reps`` synchronised steps."""
  inputs = make_inputs(case)
  step = make_step(spec, case)
  start = time.perf_counter()
  compiled = step.lower(*inputs).compile()
  compile_s = time.perf_counter() - start
  temp_bytes = compiled.memory_analysis().temp_size_in_bytes
  loss, grads = compiled(*inputs)
  jax.block_until_ready(grads)
  first_call = _first_call_extra_bytes(case)
  loss = float(loss)
  del grads
  end = time.perf_counter() + warmup_s
  while time.perf_counter() < end:
    jax.block_until_ready(compiled(*inputs))
  times = []
  for _ in range(reps):
    start = time.perf_counter()
    jax.block_until_ready(compiled(*inputs))
    times.append(time.perf_counter() - start)
  median = statistics.median(times)
  return {
    "loss": loss,
    "median_ms": median * 1e3,
    "min_ms": min(times) * 1e3,
    "tflops": case.flops / median / 1e12,
    "compile_s": compile_s,
    "temp_bytes": temp_bytes,
    **first_call,
  }


def _first_call_extra_bytes(case: Case) -> dict:
  """Peak bytes in use so far minus those in use now, after the first step.

  In the process that compiles, so the peak includes compilation (GEMM
  autotuning's scratch buffers): what a step needs the first time it runs.
  Empty where ``memory_stats()`` has nothing (a CPU).
  """
  stats = [d.memory_stats() for d in jax.devices()[: case.devices]]
  if any(s is None for s in stats):
    return {}
  extra = max(s["peak_bytes_in_use"] - s["bytes_in_use"] for s in stats)
  return {"first_call_extra_bytes": extra}


def peak_extra_bytes(spec: str, case: Case) -> dict:
  """Runs the step once; peak bytes in use minus inputs and gradients.

  For a case over several devices, per device (each device's peak minus its
  own shards); ``extra_bytes`` is then the largest of them.
  """
  devices = jax.devices()[: case.devices]
  before = [d.memory_stats()["bytes_in_use"] for d in devices]
  _stage(f"making inputs ({case.tokens:,} tokens)")
  inputs = jax.block_until_ready(make_inputs(case))
  _stage("compiling")
  step = make_step(spec, case)
  start = time.perf_counter()
  compiled = step.lower(*inputs).compile()
  load_s = time.perf_counter() - start
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
    "load_s": load_s,
  }
  if case.devices > 1:
    result["extra_bytes_per_device"] = extra
  return result


def accuracy(spec: str, case: Case) -> dict:
  """Relative error of dhidden and dweight against float32 HIGHEST logits."""
  inputs = make_inputs(case)
  grads = make_step(spec, case)(*inputs)[1]
  hidden, weight, labels, where, *teacher = inputs  # a teacher head: "distill"

  def reference(h, w):
    with jax.default_matmul_precision("highest"):
      return make_loss("naive", case)(h, w, labels, where, *teacher)

  ref = jax.jit(jax.grad(reference, argnums=case.argnums))(
    hidden.astype(jnp.float32), weight.astype(jnp.float32)
  )

  def rel(out, ref):
    out, ref = out.astype(jnp.float32), ref.astype(jnp.float32)
    return float(jnp.linalg.norm(out - ref) / jnp.linalg.norm(ref))

  names = ("dhidden_rel_err", "dweight_rel_err")
  return {name: rel(g, r) for name, g, r in zip(names, grads, ref, strict=False)}


def run_here(
  spec: str, case: Case, what: str, reps: int = 10, granularity: int = 8192
) -> dict:
  """One measurement in this process.

  ``what``: "time", "memory", "accuracy", or "fit" (the largest N, a multiple
  of ``granularity``, whose compiled step fits the device: ``bench.fit``).
  """
  result = {"case": case.name, "impl": spec, "tokens": case.tokens}
  try:
    if what == "fit":
      stats = jax.devices()[0].memory_stats()
      if stats is None:
        raise Unsupported("--fit needs a device that reports memory_stats() (a GPU)")
      capacity = stats["bytes_limit"]
      log = []
      tokens = fit.largest_tokens(spec, case, capacity, granularity, log.append)
      result.update(footprint_tokens=tokens, capacity=capacity, log=log)
    elif what == "time":
      warmup_s = 1.0 if jax.default_backend() == "gpu" else 0.0
      result.update(time_step(spec, case, reps, warmup_s))
      if jax.devices()[0].memory_stats() is None:
        result.update(extra_bytes=result["temp_bytes"], extra_method="compiled temp")
    elif what == "memory":
      result.update(peak_extra_bytes(spec, case))
    elif what == "accuracy":
      result.update(accuracy(spec, case))
    else:
      raise ValueError(what)
  except Unsupported as e:
    result["skipped"] = str(e)
  return result


def run_isolated(
  spec: str,
  case: Case,
  what: str,
  reps: int,
  env: dict,
  granularity: int = 8192,
  timeout: float | None = None,
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
    }
  )
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
    return {
      "case": case.name,
      "impl": spec,
      "tokens": case.tokens,
      "error": f"timed out after {timeout:.0f} s; " + " | ".join(stages[-3:]),
    }
  for line in proc.stdout.splitlines():
    if line.startswith(_RESULT_TAG):
      return json.loads(line[len(_RESULT_TAG) :])
  tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
  return {
    "case": case.name,
    "impl": spec,
    "tokens": case.tokens,
    "error": f"exit {proc.returncode}: " + " | ".join(tail),
  }


def main(argv=None) -> None:
  request = json.loads((argv or sys.argv[1:])[0])
  case = Case(**request["case"])
  result = run_here(
    request["impl"], case, request["what"], request["reps"], request["granularity"]
  )
  print(_RESULT_TAG + json.dumps(result, default=float), flush=True)


if __name__ == "__main__":
  main()
