"""Data- and vocab-parallel LM-head loss on a device mesh.

By default this runs on 8 simulated CPU devices (it sets
``--xla_force_host_platform_device_count=8`` before JAX starts); with GPUs, run
it with ``--devices 0`` to use the real ones. It computes a bf16 head's loss
and gradients (N=4096 tokens, D=256, V=32768 by default) with rows split over
a ``data`` axis and the vocabulary over a ``model`` axis, and prints where the
weight gradient lives and how far each result is from the single-device one.
The last line is the verdict: whether all three layouts match one device
(exit status 1 if not).

Needs only mst_jax itself (``pip install -e .``). The defaults take about
25 seconds on a two-core CPU.

  python examples/multi_device.py                 # 8 simulated CPU devices
  python examples/multi_device.py --devices 0 --data 1 --model 2   # 2 GPUs
"""

from __future__ import annotations

import argparse
import os
import sys

# bf16 gradients, relative to the largest element: a sum in another order can
# round to a neighbouring bf16 value (up to 2**-7 of it away), and the data
# parallel dweight adds the row shards' partial sums, each rounded to bf16.
TOLERANCE = 2e-2


def main(argv=None):
  parser = argparse.ArgumentParser(
    description=__doc__.split("\n\n")[0],
    formatter_class=argparse.ArgumentDefaultsHelpFormatter,
  )
  parser.add_argument(
    "--devices",
    type=int,
    default=8,
    help="simulated CPU devices (0: use the real devices)",
  )
  parser.add_argument("--data", type=int, default=2, help="size of the data axis")
  parser.add_argument("--model", type=int, default=4, help="size of the model axis")
  parser.add_argument("--tokens", type=int, default=4096, help="rows N of hidden")
  parser.add_argument("--dim", type=int, default=256, help="hidden size D")
  parser.add_argument("--vocab", type=int, default=32768, help="vocabulary size V")
  args = parser.parse_args(argv)
  if args.devices:
    os.environ["JAX_PLATFORMS"] = "cpu"
    os.environ["XLA_FLAGS"] = (
      os.environ.get("XLA_FLAGS", "")
      + f" --xla_force_host_platform_device_count={args.devices}"
    )
  if "jax" in sys.modules:
    raise SystemExit("run this as a script: the device count is set before JAX starts")

  import jax
  import jax.numpy as jnp
  import numpy as np
  from jax.sharding import Mesh, NamedSharding
  from jax.sharding import PartitionSpec as P

  import mst_jax

  devices = np.array(jax.devices()[: args.data * args.model])
  mesh = Mesh(devices.reshape(args.data, args.model), ("data", "model"))
  print(f"{len(devices)} {devices.flat[0].platform} devices, mesh {dict(mesh.shape)}")

  k1, k2, k3 = jax.random.split(jax.random.key(0), 3)
  hidden = jax.random.normal(k1, (args.tokens, args.dim), jnp.bfloat16)
  weight = (jax.random.normal(k2, (args.vocab, args.dim)) * 0.05).astype(jnp.bfloat16)
  labels = jax.random.randint(k3, (args.tokens,), 0, args.vocab)
  where = jnp.arange(args.tokens) % 4 != 0  # some tokens excluded

  # Inputs where they would live in a sharded model: rows over data, the
  # [V, D] weight's rows over model.
  hidden = jax.device_put(hidden, NamedSharding(mesh, P("data", None)))
  weight = jax.device_put(weight, NamedSharding(mesh, P("model", None)))

  def loss(hidden, weight, **kwargs):
    return mst_jax.linear_cross_entropy(hidden, weight, labels, where=where, **kwargs)

  step = jax.jit(
    jax.value_and_grad(loss, argnums=(0, 1)),
    static_argnames=("mesh", "batch_axis", "vocab_axis"),
  )
  layouts = {
    "data parallel": dict(batch_axis="data"),
    "vocab parallel": dict(vocab_axis="model"),
    "data x vocab parallel": dict(batch_axis="data", vocab_axis="model"),
  }
  single = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))(
    *(jax.device_put(x, devices.flat[0]) for x in (hidden, weight))
  )
  print(f"{'one device':>21}: loss {float(single[0]):.5f}")
  as_f32 = lambda x: np.asarray(x, np.float32)
  worst = 0.0
  for name, axes in layouts.items():
    value, grads = step(hidden, weight, mesh=mesh, **axes)
    # Each result's largest difference from one device's, relative to the
    # largest magnitude of one device's.
    errors = [
      float(np.abs(as_f32(x) - as_f32(ref)).max() / np.abs(as_f32(ref)).max())
      for x, ref in zip((value, *grads), (single[0], *single[1]), strict=True)
    ]
    worst = max(worst, *errors)
    print(
      f"{name:>21}: loss {float(value):.5f}; relative error: loss {errors[0]:.0e},"
      f" dhidden {errors[1]:.0e}, dweight {errors[2]:.0e};"
      f" dweight sharded as {grads[1].sharding.spec}"
    )
  verdict = "match" if worst <= TOLERANCE else "DO NOT match"
  print(
    f"verdict: the sharded layouts {verdict} one device's loss and gradients"
    f" (worst relative error {worst:.1e}, tolerance {TOLERANCE:.0e})"
  )
  if worst > TOLERANCE:
    raise SystemExit(1)


if __name__ == "__main__":
  main()
