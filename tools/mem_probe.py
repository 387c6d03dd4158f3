"""Where a step's measured extra memory goes, stage by stage (GPU).

  python tools/mem_probe.py [--case llama] SPEC [SPEC ...]

For each implementation spec (as ``python -m mst_jax.bench --impls`` takes
them) runs the benchmark's memory measurement twice in fresh processes (the
first fills a persistent compilation cache, the second loads from it, as
``mst_jax.bench`` does) and prints, from the second, ``memory_stats()`` after
making the inputs, after loading the executable, and after one step, with the
executable's ``memory_analysis()``; the gap between the peak and inputs +
gradients + compiled temporaries is what the allocator held beyond XLA's own
buffer assignment.
"""

import json
import os
import subprocess
import sys
import tempfile

MiB = 2**20


def child(case_name: str, spec: str) -> None:
  import jax

  from mst_jax.bench.cases import CASES, make_inputs, make_step
  from mst_jax.bench.measure import _nbytes

  case = CASES[case_name]
  device = jax.devices()[0]
  if device.memory_stats() is None:
    raise SystemExit("mem_probe needs a device that reports memory_stats() (a GPU)")
  stats = lambda: {
    k: v / MiB
    for k, v in device.memory_stats().items()
    if k.endswith("bytes_in_use")
    or k in ("largest_alloc_size", "num_allocs", "pool_bytes", "peak_pool_bytes")
  }
  out = {"start": stats()}
  inputs = make_inputs(case)
  jax.block_until_ready(inputs)
  out["inputs_made"] = stats()
  compiled = make_step(spec, case).lower(*inputs).compile()
  analysis = compiled.memory_analysis()
  out["analysis"] = {
    k: getattr(analysis, k) / MiB for k in dir(analysis) if k.endswith("_in_bytes")
  }
  out["loaded"] = stats()
  loss, grads = compiled(*inputs)
  jax.block_until_ready(grads)
  out["stepped"] = stats()
  out["inputs_MiB"] = _nbytes(inputs, device) / MiB
  out["grads_MiB"] = _nbytes((grads, loss), device) / MiB
  out["extra_MiB"] = (
    out["stepped"]["peak_bytes_in_use"]
    - out["start"]["bytes_in_use"]
    - out["inputs_MiB"]
    - out["grads_MiB"]
  )
  out["beyond_temps_MiB"] = out["extra_MiB"] - out["analysis"]["temp_size_in_bytes"]
  del grads, loss
  out["after_free"] = stats()
  print("PROBE " + json.dumps(out))


def main(argv: list[str]) -> None:
  case = "llama"
  if argv[:1] == ["--case"]:
    case, argv = argv[1], argv[2:]
  from mst_jax.bench.measure import isolated_env

  env = {**os.environ, **isolated_env(tempfile.mkdtemp(prefix="mem_probe_"))}
  for spec in argv:
    for attempt in ("compile", "load"):
      proc = subprocess.run(
        [sys.executable, __file__, "--child", case, spec],
        capture_output=True,
        text=True,
        env=env,
        check=False,
      )
      lines = [x for x in proc.stdout.splitlines() if x.startswith("PROBE ")]
      if not lines:
        print(spec, attempt, "failed:", proc.stderr[-2000:])
        break
      if attempt == "load":
        result = json.loads(lines[0][6:])
        print(f"== {case} {spec}")
        for key, value in result.items():
          if isinstance(value, dict):
            value = {k: round(v, 2) for k, v in value.items()}
          elif isinstance(value, float):
            value = round(value, 2)
          print(f"  {key}: {value}")


if __name__ == "__main__":
  if sys.argv[1:2] == ["--child"]:
    child(sys.argv[2], sys.argv[3])
  else:
    main(sys.argv[1:])
