"""Distil a small byte-level language model with ``mst_jax.linear_distillation_loss``.

Offline and self-contained (jax, optax and numpy only): the corpus is this
Python's own standard library source, read as bytes (``V = 256``). The models
are windowed MLP language models: each position sees the embeddings of the
last ``--context`` bytes, an MLP turns them into a hidden state, and an LM head
(weight ``[V, D]``) scores the next byte.

1. A teacher (``--teacher-dim``) is trained on the next byte with
   ``mst_jax.linear_cross_entropy``.
2. A smaller student (``--student-dim``) is trained from it with
   ``mst_jax.linear_distillation_loss``: the KL divergence from the teacher's
   next-byte distribution (at ``--temperature``) plus ``--hard-label-weight``
   times the cross-entropy on the true byte. The teacher's hidden states come
   from its frozen network; the loss differentiates only the student.
3. The same student, from the same initialisation and for as many steps, is
   trained on the true bytes alone.

Both students are then scored on held-out bytes (the last 10% of the corpus),
and the last line is the verdict: whether distillation helped, by how much.
With the defaults the distilled student ends a few hundredths of a nat per
byte below the one trained on hard labels. The loss has no ``T**2`` factor, so
at a temperature above 1 its gradients are smaller (about ``1 / T**2``): raise
the learning rate with it, or stay at ``T = 1`` as the defaults do.

It needs the examples extra (``pip install -e ".[examples]"``, for optax); the
defaults take 50 to 60 seconds on a two-core CPU.

  pip install -e ".[examples]"
  python examples/distill_tiny_lm.py
"""

from __future__ import annotations

import argparse
import functools
import pathlib
import sysconfig
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

import mst_jax

VOCAB = 256  # bytes


def load_corpus(max_bytes: int) -> np.ndarray:
  """The standard library's ``.py`` files as bytes (uint8), up to ``max_bytes``."""
  stdlib = pathlib.Path(sysconfig.get_paths()["stdlib"])
  parts, size = [], 0
  for path in sorted(stdlib.rglob("*.py")):
    if "site-packages" in path.parts or "test" in path.parts:
      continue
    try:
      data = path.read_bytes()
    except OSError:
      continue
    parts.append(np.frombuffer(data, np.uint8))
    size += len(data)
    if size >= max_bytes:
      break
  return np.concatenate(parts)[:max_bytes]


def init_model(key, *, context: int, embed: int, dim: int) -> dict:
  """A windowed MLP LM: embeddings, two layers to a ``dim`` hidden state, a head."""
  k_embed, k_in, k_out, k_head = jax.random.split(key, 4)
  width = context * embed
  normal = lambda k, shape, fan_in: jax.random.normal(k, shape) / np.sqrt(fan_in)
  return {
    "embed": jax.random.normal(k_embed, (VOCAB, embed)) * 0.1,
    "w_in": normal(k_in, (width, 2 * dim), width),
    "b_in": jnp.zeros(2 * dim),
    "w_out": normal(k_out, (2 * dim, dim), 2 * dim),
    "b_out": jnp.zeros(dim),
    "head": normal(k_head, (VOCAB, dim), dim),  # [V, D]: weight_layout="vd"
  }


def hidden_states(params: dict, window: jax.Array) -> jax.Array:
  """``[B, T, D]`` hidden states from ``window`` ``[B, T + context - 1]`` bytes:
  position ``t`` sees bytes ``t .. t + context - 1`` (the last is its own)."""
  context = params["w_in"].shape[0] // params["embed"].shape[1]
  length = window.shape[1] - context + 1
  embedded = params["embed"][window]  # [B, T + context - 1, E]
  windows = [embedded[:, i : i + length] for i in range(context)]
  x = jnp.concatenate(windows, axis=-1)  # [B, T, context * E]
  x = jax.nn.gelu(x @ params["w_in"] + params["b_in"])
  return jnp.tanh(x @ params["w_out"] + params["b_out"])


def split_batch(batch: jax.Array, context: int):
  """A batch of ``[B, context + T]`` bytes as (windows, next bytes ``[B, T]``)."""
  return batch[:, :-1], batch[:, context:]


def hard_loss(params: dict, batch: jax.Array, context: int) -> jax.Array:
  """Mean next-byte cross-entropy (nats)."""
  window, labels = split_batch(batch, context)
  return mst_jax.linear_cross_entropy(
    hidden_states(params, window), params["head"], labels
  )


def distill_loss(student, batch, teacher, *, context, temperature, hard_weight):
  """KL(teacher || student) at ``temperature`` + ``hard_weight`` x the
  cross-entropy; the teacher is frozen (not differentiated)."""
  window, labels = split_batch(batch, context)
  teacher = jax.lax.stop_gradient(teacher)
  return mst_jax.linear_distillation_loss(
    hidden_states(student, window),
    student["head"],
    hidden_states(teacher, window),
    teacher["head"],
    labels,
    temperature=temperature,
    hard_label_weight=hard_weight,
  )


def batches(data: np.ndarray, batch: int, length: int, rng: np.random.Generator):
  while True:
    starts = rng.integers(0, len(data) - length, batch)
    yield jnp.asarray(np.stack([data[s : s + length] for s in starts]), jnp.int32)


def train(params, loss_fn, steps: int, lr: float, data, *frozen) -> tuple[dict, list]:
  """Adam with a cosine decay on ``loss_fn(params, batch, *frozen)``; returns
  the parameters and the losses."""
  optimizer = optax.adamw(optax.cosine_decay_schedule(lr, max(steps, 1)))
  state = optimizer.init(params)

  @jax.jit
  def step(params, state, batch, *frozen):
    loss, grads = jax.value_and_grad(loss_fn)(params, batch, *frozen)
    updates, state = optimizer.update(grads, state, params)
    return optax.apply_updates(params, updates), state, loss

  losses = []
  for _ in range(steps):
    params, state, loss = step(params, state, next(data), *frozen)
    losses.append(float(loss))
  return params, losses


def held_out_loss(params, data: np.ndarray, context: int, batch: int, length: int):
  """Mean next-byte cross-entropy over consecutive held-out windows."""
  n = (len(data) - context) // length
  windows = np.stack(
    [data[i * length : i * length + context + length] for i in range(n)]
  )
  evaluate = jax.jit(lambda p, b: hard_loss(p, b, context))
  totals = [
    float(evaluate(params, jnp.asarray(windows[i : i + batch], jnp.int32)))
    * len(windows[i : i + batch])
    for i in range(0, n, batch)
  ]
  return sum(totals) / n


def main(argv=None):
  parser = argparse.ArgumentParser(
    description=__doc__.split("\n\n")[0],
    formatter_class=argparse.ArgumentDefaultsHelpFormatter,
  )
  parser.add_argument(
    "--corpus-mib", type=float, default=2.0, help="MiB of stdlib source"
  )
  parser.add_argument(
    "--context", type=int, default=16, help="bytes each position sees"
  )
  parser.add_argument("--seq-len", type=int, default=128, help="positions per sequence")
  parser.add_argument("--batch", type=int, default=32, help="sequences per step")
  parser.add_argument("--teacher-dim", type=int, default=256, help="teacher hidden D_t")
  parser.add_argument(
    "--teacher-embed", type=int, default=32, help="teacher byte embedding"
  )
  parser.add_argument(
    "--teacher-steps", type=int, default=600, help="teacher training steps"
  )
  parser.add_argument("--student-dim", type=int, default=64, help="student hidden D_s")
  parser.add_argument(
    "--student-embed", type=int, default=16, help="student byte embedding"
  )
  parser.add_argument(
    "--student-steps", type=int, default=300, help="steps per student"
  )
  parser.add_argument("--lr", type=float, default=3e-3, help="Adam learning rate")
  parser.add_argument(
    "--temperature", type=float, default=1.0, help="distillation temperature T"
  )
  parser.add_argument(
    "--hard-label-weight",
    type=float,
    default=0.0,
    help="weight of the true-byte cross-entropy in the distillation loss",
  )
  parser.add_argument(
    "--eval-batches", type=int, default=64, help="held-out batches to score"
  )
  parser.add_argument("--seed", type=int, default=0, help="random seed")
  args = parser.parse_args(argv)

  device = jax.devices()[0]
  print(f"jax {jax.__version__} on {device.platform} ({device.device_kind})")
  start = time.perf_counter()
  corpus = load_corpus(int(args.corpus_mib * 2**20))
  split = int(0.9 * len(corpus))
  train_data, test_data = corpus[:split], corpus[split:]
  test_data = test_data[: args.eval_batches * args.batch * args.seq_len + args.context]
  print(
    f"corpus: {len(corpus) / 2**20:.1f} MiB of stdlib source (bytes, V={VOCAB});"
    f" held out {len(test_data):,} bytes"
  )
  ctx, length = args.context, args.context + args.seq_len
  key_teacher, key_student = jax.random.split(jax.random.key(args.seed))
  data = lambda seed: batches(
    train_data, args.batch, length, np.random.default_rng(seed)
  )
  evaluate = lambda p: held_out_loss(p, test_data, ctx, args.batch, args.seq_len)

  teacher = init_model(
    key_teacher, context=ctx, embed=args.teacher_embed, dim=args.teacher_dim
  )
  teacher, losses = train(
    teacher,
    lambda p, b: hard_loss(p, b, ctx),
    args.teacher_steps,
    args.lr,
    data(args.seed),
  )
  teacher_test = evaluate(teacher)
  print(
    f"teacher (D_t={args.teacher_dim}, {args.teacher_steps} steps):"
    f" train loss {np.mean(losses[-10:]):.3f}, held-out loss {teacher_test:.3f}"
    f" nats/byte ({time.perf_counter() - start:.0f} s)"
  )

  student_init = init_model(
    key_student, context=ctx, embed=args.student_embed, dim=args.student_dim
  )
  distill = functools.partial(
    distill_loss,
    context=ctx,
    temperature=args.temperature,
    hard_weight=args.hard_label_weight,
  )
  students = {}
  for name, what, loss_fn, frozen in [
    ("distilled", "distillation loss", distill, (teacher,)),
    ("hard labels", "loss", lambda p, b: hard_loss(p, b, ctx), ()),
  ]:
    params, losses = train(
      student_init, loss_fn, args.student_steps, args.lr, data(args.seed + 1), *frozen
    )
    students[name] = evaluate(params)
    print(
      f"student (D_s={args.student_dim}, {args.student_steps} steps) on {name}:"
      f" train {what} {np.mean(losses[-10:]):.3f}, held-out loss"
      f" {students[name]:.3f} nats/byte ({time.perf_counter() - start:.0f} s)"
    )

  gain = students["hard labels"] - students["distilled"]
  verdict = "helped" if gain > 0 else "did not help"
  print(
    f"verdict: distillation {verdict}: the distilled student's held-out loss is"
    f" {students['distilled']:.3f} against {students['hard labels']:.3f} on hard"
    f" labels alone ({gain:+.3f} nats/byte; the teacher's is {teacher_test:.3f})"
  )


if __name__ == "__main__":
  main()
