"""Data- and vocab-parallel LM-head loss on a device mesh.

By default this runs on 8 simulated CPU devices (it sets
``--xla_force_host_platform_device_count=8`` before JAX starts); with GPUs, run
it with ``--devices 0`` to use the real ones. It computes the Llama-3-like
head's loss and gradients with rows split over a ``data`` axis and the
vocabulary over a ``model`` axis, checks them against the single-device
result, and shows where the weight gradient lives.

  python examples/multi_device.py                 # 8 simulated CPU devices
  python examples/multi_device.py --devices 0 --data 1 --model 2   # 2 GPUs
"""

from __future__ import annotations

import argparse
import os
import sys


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument(
    "--devices",
    type=int,
    default=8,
    help="simulated CPU devices (0: use the real devices)",
  )
  parser.add_argument("--data", type=int, default=2, help="size of the data axis")
  parser.add_argument("--model", type=int, default=4, help="size of the model axis")
  parser.add_argument("--tokens", type=int, default=4096)
  parser.add_argument("--dim", type=int, default=256)
  parser.add_argument("--vocab", type=int, default=32768)
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
  for name, axes in layouts.items():
    value, (dhidden, dweight) = step(hidden, weight, mesh=mesh, **axes)
    spec = dweight.sharding.spec
    as_f32 = lambda x: np.asarray(x.astype(jnp.float32))
    err = float(np.abs(as_f32(dweight) - as_f32(single[1][1])).max())
    print(
      f"{name:>22}: loss {float(value):.5f} (one device {float(single[0]):.5f}),"
      f" max |dweight diff| {err:.1e}, dweight sharded as {spec}"
    )


if __name__ == "__main__":
  main()
