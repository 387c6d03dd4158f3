"""How long a sequence fits: a Llama-3.2-1B-shaped model, naive head vs LMHeadLoss.

The model has Llama-3.2-1B's shapes (D=2048, 16 layers, 32 query and 8 key/value
heads, MLP 8192, V=128256, tied embeddings), bf16 parameters and activations,
rematerialised layers (``nnx.remat`` inside ``nnx.scan``) and flash attention
(``jax.nn.dot_product_attention``, cuDNN on a GPU); no RoPE, which changes
neither memory nor speed. A full training step (forward, backward, AdamW) is
compiled at batch 1 and sequence length T, and T is bisected for the largest
one whose compiled footprint (``memory_analysis``: arguments + outputs +
temporaries) fits the device. Then both heads train a few steps at a length
both fit and report tokens/s. The last line is the verdict: how many times
longer a sequence LMHeadLoss trains, and its speed against the naive head's.

On a CPU the default is ``--preset tiny``: Llama-3's vocabulary on a model of
width 64 with one attention head, fitted in 2 GiB (a CPU reports no memory
limit), where the head's logits, not attention, bound the naive head's
sequence. It needs the examples extra (``pip install -e ".[examples]"``) and
takes about 110 seconds on a two-core CPU.

  XLA_PYTHON_CLIENT_MEM_FRACTION=0.95 python examples/long_context.py  # GPU
  python examples/long_context.py  # a CPU: --preset tiny
"""

from __future__ import annotations

import argparse
import dataclasses
import time

import jax
import jax.numpy as jnp
import optax
from flax import nnx

import mst_jax
from mst_jax.bench.fit import compiled_footprint, largest_fitting


@dataclasses.dataclass(frozen=True)
class Config:
  dim: int = 2048
  layers: int = 16
  heads: int = 32
  kv_heads: int = 8
  mlp: int = 8192
  vocab: int = 128256
  # LMHeadLoss's memory_budget (None: its default, 2.25 GiB): the tiny preset
  # fits in 2 GiB, so its head gets an eighth of that.
  head_budget: int | None = None


PRESETS = {
  "llama-3.2-1b": Config(),
  "tiny": Config(
    dim=64, layers=2, heads=1, kv_heads=1, mlp=256, vocab=128256, head_budget=2**28
  ),
}
# Each preset's sequence lengths to search: (low, high, granularity).
SEARCH = {"llama-3.2-1b": (8192, 1 << 21, 4096), "tiny": (256, 1 << 16, 256)}
# What to fit in where the device reports no memory limit (a CPU).
UNLIMITED_CAPACITY = 2 * 2**30


class Block(nnx.Module):
  def __init__(self, cfg: Config, rngs: nnx.Rngs):
    head_dim = cfg.dim // cfg.heads
    linear = lambda i, o: nnx.Linear(
      i, o, use_bias=False, dtype=jnp.bfloat16, param_dtype=jnp.bfloat16, rngs=rngs
    )
    norm = lambda: nnx.RMSNorm(
      cfg.dim, dtype=jnp.bfloat16, param_dtype=jnp.bfloat16, rngs=rngs
    )
    self.attn_norm, self.mlp_norm = norm(), norm()
    self.q = linear(cfg.dim, cfg.heads * head_dim)
    self.k = linear(cfg.dim, cfg.kv_heads * head_dim)
    self.v = linear(cfg.dim, cfg.kv_heads * head_dim)
    self.o = linear(cfg.heads * head_dim, cfg.dim)
    self.gate, self.up = linear(cfg.dim, cfg.mlp), linear(cfg.dim, cfg.mlp)
    self.down = linear(cfg.mlp, cfg.dim)
    self.cfg = cfg

  def __call__(self, x):
    cfg, (batch, seq, _) = self.cfg, x.shape
    head_dim = cfg.dim // cfg.heads
    h = self.attn_norm(x)
    q = self.q(h).reshape(batch, seq, cfg.heads, head_dim)
    k = self.k(h).reshape(batch, seq, cfg.kv_heads, head_dim)
    v = self.v(h).reshape(batch, seq, cfg.kv_heads, head_dim)
    impl = "cudnn" if jax.default_backend() == "gpu" else None
    a = jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation=impl)
    x = x + self.o(a.reshape(batch, seq, cfg.heads * head_dim))
    h = self.mlp_norm(x)
    return x + self.down(jax.nn.silu(self.gate(h)) * self.up(h))


class Model(nnx.Module):
  def __init__(self, cfg: Config, head: str, rngs: nnx.Rngs):
    self.embed = nnx.Embed(
      cfg.vocab, cfg.dim, dtype=jnp.bfloat16, param_dtype=jnp.bfloat16, rngs=rngs
    )

    @nnx.split_rngs(splits=cfg.layers)
    @nnx.vmap(in_axes=(0,), out_axes=0)
    def blocks(rngs):
      return Block(cfg, rngs)

    self.blocks = blocks(rngs)
    self.norm = nnx.RMSNorm(
      cfg.dim, dtype=jnp.bfloat16, param_dtype=jnp.bfloat16, rngs=rngs
    )
    self.head_kind = head
    if head == "mst":
      budget = {} if cfg.head_budget is None else {"memory_budget": cfg.head_budget}
      self.head = mst_jax.LMHeadLoss(
        cfg.dim, cfg.vocab, embedding=self.embed, rngs=rngs, **budget
      )

  def loss(self, tokens):
    x = self.embed(tokens)

    @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
    @nnx.remat
    def layer(x, block):
      return block(x)

    hidden = self.norm(layer(x, self.blocks))[:, :-1]
    labels = tokens[:, 1:]
    if self.head_kind == "mst":
      return self.head(hidden, labels)
    # The naive head: bf16 logits from the tied table, cast to float32.
    logits = jnp.dot(hidden, self.embed.embedding[...].T).astype(jnp.float32)
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()


def _model_and_optimizer(cfg: Config, head: str):
  model = Model(cfg, head, nnx.Rngs(0))
  return model, nnx.Optimizer(model, optax.adamw(1e-4), wrt=nnx.Param)


def make_step(cfg: Config, head: str):
  model, optimizer = nnx.eval_shape(lambda: _model_and_optimizer(cfg, head))

  @nnx.jit(donate_argnums=(0, 1))
  def step(model, optimizer, tokens):
    loss, grads = nnx.value_and_grad(lambda m: m.loss(tokens))(model)
    optimizer.update(model, grads)
    return loss

  return step, model, optimizer


def footprint(cfg: Config, head: str, seq: int) -> float:
  """Compiled bytes of one training step at batch 1 x ``seq`` (inf: no compile)."""
  step, model, optimizer = make_step(cfg, head)
  tokens = jax.ShapeDtypeStruct((1, seq), jnp.int32)
  return compiled_footprint(lambda: step.lower(model, optimizer, tokens))


def tokens_per_second(cfg, head, seq, steps):
  model, optimizer = _model_and_optimizer(cfg, head)

  @nnx.jit
  def step(model, optimizer, tokens):
    loss, grads = nnx.value_and_grad(lambda m: m.loss(tokens))(model)
    optimizer.update(model, grads)
    return loss

  tokens = jax.random.randint(jax.random.key(0), (1, seq), 0, cfg.vocab)
  jax.block_until_ready(step(model, optimizer, tokens))
  start = time.perf_counter()
  for _ in range(steps):
    loss = step(model, optimizer, tokens)
  jax.block_until_ready(loss)
  return seq * steps / (time.perf_counter() - start), float(loss)


def main(argv=None):
  parser = argparse.ArgumentParser(
    description=__doc__.split("\n\n")[0],
    formatter_class=argparse.ArgumentDefaultsHelpFormatter,
  )
  parser.add_argument(
    "--preset",
    choices=sorted(PRESETS),
    default=None,
    help="model shapes (None: llama-3.2-1b on an accelerator, tiny on a CPU)",
  )
  parser.add_argument(
    "--low", type=int, default=None, help="shortest T (None: the preset's)"
  )
  parser.add_argument(
    "--high", type=int, default=None, help="longest T (None: the preset's)"
  )
  parser.add_argument(
    "--granularity",
    type=int,
    default=None,
    help="T is searched in multiples of this (None: the preset's)",
  )
  parser.add_argument(
    "--capacity-gib",
    type=float,
    default=None,
    help="memory to fit in (None: the device's limit, or 2 GiB on a CPU)",
  )
  parser.add_argument(
    "--speed-seq",
    type=int,
    default=None,
    help="sequence length for tokens/s (None: the longest the naive head fits)",
  )
  parser.add_argument(
    "--steps", type=int, default=5, help="timed training steps per head"
  )
  parser.add_argument(
    "--fit",
    action=argparse.BooleanOptionalAction,
    default=True,
    help="bisect the longest sequence (--no-fit: only tokens/s at --speed-seq)",
  )
  args = parser.parse_args(argv)
  device = jax.devices()[0]
  preset = args.preset or ("tiny" if device.platform == "cpu" else "llama-3.2-1b")
  cfg = PRESETS[preset]
  stats = device.memory_stats() or {}
  capacity = (
    int(args.capacity_gib * 2**30)
    if args.capacity_gib
    else stats.get("bytes_limit", UNLIMITED_CAPACITY)
  )
  low, high, granularity = SEARCH[preset]
  low, high = args.low or low, args.high or high
  granularity = args.granularity or granularity
  print(
    f"jax {jax.__version__} on {device.device_kind}; {preset}; fitting in"
    f" {capacity / 2**30:.1f} GiB; T in [{low:,}, {high:,}] to {granularity:,}",
    flush=True,
  )
  longest = {}
  for head in ("naive", "mst") if args.fit else ():
    longest[head] = largest_fitting(
      lambda seq, head=head: footprint(cfg, head, seq) <= capacity,
      low,
      high,
      granularity,
      lambda s, head=head: print(f"  {head}: T={s}", flush=True),
    )
    print(
      f"longest training sequence, {head} head: {longest[head]:,} tokens", flush=True
    )
  seq = args.speed_seq or longest.get("naive") or low
  rates = {}
  for head in ("naive", "mst"):
    rates[head], loss = tokens_per_second(cfg, head, seq, args.steps)
    print(
      f"{head} head at T={seq:,}: {rates[head]:,.0f} tokens/s (loss {loss:.3f})",
      flush=True,
    )
  print(f"verdict: {_verdict(longest, capacity, seq, rates)}")


def _verdict(longest: dict, capacity: int, seq: int, rates: dict) -> str:
  speed = f"tokens/s at T={seq:,} are {rates['mst'] / rates['naive']:.2f}x"
  if not longest:
    return f"LMHeadLoss's {speed} the naive head's"
  fits = (
    f"LMHeadLoss trains sequences of up to {longest['mst']:,} tokens in"
    f" {capacity / 2**30:.1f} GiB"
  )
  if longest["naive"]:
    ratio = longest["mst"] / longest["naive"]
    fits += f", {ratio:.1f}x the naive head's {longest['naive']:,}"
  else:
    fits += ", where the naive head fits none"
  return f"{fits}; its {speed} the naive head's"


if __name__ == "__main__":
  main()
