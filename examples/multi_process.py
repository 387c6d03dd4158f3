"""mst_jax across processes: data and vocab parallel, checked against one process.

Starts ``--processes`` local processes that join one JAX runtime with
``jax.distributed.initialize`` (as the hosts of a multi-host job do), each
with ``--devices-per-process`` CPU devices (CPU collectives) or, when GPUs
are present, one GPU each. Every process builds the same problem, feeds its
own shards of it to a mesh over all processes' devices, and runs the loss and
its gradients data parallel, vocab parallel and both. Process 0 then gathers
the results and compares them with the same loss computed in one process on
one device.

  python examples/multi_process.py --processes 2
  python examples/multi_process.py --processes 2 --platform gpu   # 2 GPUs

It prints one line per layout and a verdict, and exits with status 1 when a
result does not match.
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys

# float32: the loss and the sharded gradients agree with one device to this.
TOLERANCE = 1e-4
N_TOKENS, HIDDEN, VOCAB = 96, 64, 4096


def _parse() -> argparse.Namespace:
  parser = argparse.ArgumentParser(
    description=__doc__.split("\n\n")[0],
    formatter_class=argparse.ArgumentDefaultsHelpFormatter,
  )
  parser.add_argument("--processes", type=int, default=2, help="processes to start")
  parser.add_argument(
    "--devices-per-process",
    type=int,
    default=2,
    help="CPU devices each process holds (with --platform gpu: one GPU each)",
  )
  parser.add_argument(
    "--platform",
    choices=("cpu", "gpu"),
    default="cpu",
    help="cpu: simulated CPU devices; gpu: process i uses GPU i",
  )
  parser.add_argument("--timeout", type=float, default=300.0, help="seconds to wait")
  parser.add_argument("--rank", type=int, default=None, help=argparse.SUPPRESS)
  parser.add_argument("--coordinator", default=None, help=argparse.SUPPRESS)
  return parser.parse_args()


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("localhost", 0))
    return s.getsockname()[1]


def launch(args: argparse.Namespace) -> int:
  """Starts the processes, prints process 0's report, returns the exit status."""
  coordinator = f"localhost:{_free_port()}"
  children = []
  for rank in range(args.processes):
    env = dict(os.environ)
    if args.platform == "gpu":
      env["CUDA_VISIBLE_DEVICES"] = str(rank)
      env["JAX_PLATFORMS"] = "cuda"
    else:
      env["JAX_PLATFORMS"] = "cpu"
      flag = f"--xla_force_host_platform_device_count={args.devices_per_process}"
      env["XLA_FLAGS"] = f"{env.get('XLA_FLAGS', '')} {flag}".strip()
    command = [sys.executable, __file__, *sys.argv[1:]]
    command += ["--rank", str(rank), "--coordinator", coordinator]
    children.append(
      subprocess.Popen(
        command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
      )
    )
  status = 0
  for rank, child in enumerate(children):
    try:
      out, err = child.communicate(timeout=args.timeout)
    except subprocess.TimeoutExpired:
      for other in children:
        other.kill()
      print(f"process {rank} did not finish in {args.timeout:.0f} s")
      return 1
    if rank == 0:  # without the collectives library's connection lines
      print(
        "".join(line for line in out.splitlines(True) if "[Gloo]" not in line), end=""
      )
    if child.returncode:
      print(f"process {rank} exited with {child.returncode}:\n{err[-3000:]}")
      status = 1
  return status


def run(args: argparse.Namespace) -> int:
  """One process of the job."""
  import jax

  jax.distributed.initialize(
    coordinator_address=args.coordinator,
    num_processes=args.processes,
    process_id=args.rank,
  )
  import numpy as np
  from jax.experimental import multihost_utils
  from jax.sharding import NamedSharding
  from jax.sharding import PartitionSpec as P

  import mst_jax

  rng = np.random.default_rng(0)  # the same problem in every process
  hidden = rng.standard_normal((N_TOKENS, HIDDEN)).astype(np.float32)
  weight = (rng.standard_normal((VOCAB, HIDDEN)) / 8).astype(np.float32)
  labels = rng.integers(0, VOCAB, N_TOKENS).astype(np.int32)
  labels[rng.random(N_TOKENS) < 0.3] = -100

  devices = np.array(jax.devices())
  options = dict(label_smoothing=0.1, z_loss=1e-4)

  def step(mesh, batch_axis, vocab_axis):
    def put(x, spec):  # each process supplies only the shards it holds
      sharding = NamedSharding(mesh, spec)
      return jax.make_array_from_callback(x.shape, sharding, lambda index: x[index])

    weight_spec = P(vocab_axis, None)
    args = (put(hidden, P(batch_axis, None)), put(weight, weight_spec))
    y = put(labels, P(batch_axis))

    def loss(h, w, y):  # arrays spanning processes are arguments, not constants
      return mst_jax.linear_cross_entropy(
        h, w, y, mesh=mesh, batch_axis=batch_axis, vocab_axis=vocab_axis, **options
      )

    value, grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))(*args, y)
    grads = multihost_utils.process_allgather(grads, tiled=True)
    return float(value), [np.asarray(g) for g in grads]

  n = devices.size
  layouts = {
    f"data parallel ({n} devices)": ((n, 1), "data", None),
    f"vocab parallel ({n} devices)": ((1, n), None, "model"),
  }
  if n % 2 == 0 and n > 2:
    layouts[f"both ({n // 2} x 2)"] = ((n // 2, 2), "data", "model")
  results = {}
  for name, (shape, batch_axis, vocab_axis) in layouts.items():
    mesh = jax.sharding.Mesh(devices.reshape(shape), ("data", "model"))
    results[name] = step(mesh, batch_axis, vocab_axis)

  if jax.process_index() != 0:
    return 0
  local = jax.local_devices()[0]
  one = [jax.device_put(x, local) for x in (hidden, weight, labels)]
  ref_value, ref_grads = jax.value_and_grad(
    lambda h, w: mst_jax.linear_cross_entropy(h, w, one[2], **options),
    argnums=(0, 1),
  )(*one[:2])
  ref_grads = [np.asarray(g) for g in ref_grads]

  print(
    f"{jax.process_count()} processes, {n} {devices.flat[0].platform} devices;"
    f" N={N_TOKENS}, D={HIDDEN}, V={VOCAB}; against one process on one device:"
  )
  worst = 0.0
  for name, (value, grads) in results.items():
    errors = [abs(value - float(ref_value)) / abs(float(ref_value))]
    errors += [
      float(np.linalg.norm(g - r) / np.linalg.norm(r))
      for g, r in zip(grads, ref_grads, strict=True)
    ]
    worst = max(worst, *errors)
    print(
      f"  {name:28s} loss {value:.6f} (rel. err {errors[0]:.1e}),"
      f" dhidden {errors[1]:.1e}, dweight {errors[2]:.1e}"
    )
  verdict = "match" if worst <= TOLERANCE else "DO NOT match"
  print(
    f"verdict: the multi-process results {verdict} one process (worst {worst:.1e})."
  )
  return 0 if worst <= TOLERANCE else 1


def main() -> int:
  args = _parse()
  if args.rank is None:
    return launch(args)
  return run(args)


if __name__ == "__main__":
  sys.exit(main())
