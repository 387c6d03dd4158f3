"""Train a small causal transformer (Flax NNX) with ``mst_jax.LMHeadLoss``.

Offline and self-contained: the corpus is this Python's own standard library
source, tokenized with a byte-level BPE trained here by the ``tokenizers``
package. The train step is ``nnx.jit``-compiled with optax. At the end it
compares the compiled memory of the loss (value and gradients) with
``LMHeadLoss`` against a naive ``nnx.Linear`` head on the same model. The last
line is the verdict: whether the loss fell (exit status 1 if not).

It needs the examples extra (``pip install -e ".[examples]"``: tokenizers,
optax, tqdm); without it, it says so and exits with status 2. The defaults
take 45 to 60 seconds on a two-core CPU.

  pip install -e ".[examples]"
  python examples/train_tiny_lm.py
  python examples/train_tiny_lm.py --steps 2000 --dim 512 --layers 8  # a GPU
"""

from __future__ import annotations

import argparse
import pathlib
import sys
import sysconfig
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import mst_jax

try:  # the examples extra, which mst_jax itself does not install
  import optax
  from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
  from tqdm import tqdm
except ImportError as error:
  MISSING = error.name
else:
  MISSING = None


def load_corpus(max_bytes: int) -> str:
  """Concatenated ``.py`` files of the standard library, up to ``max_bytes``."""
  stdlib = pathlib.Path(sysconfig.get_paths()["stdlib"])
  texts, size = [], 0
  for path in sorted(stdlib.rglob("*.py")):
    if "site-packages" in path.parts or "test" in path.parts:
      continue
    try:
      text = path.read_text(encoding="utf-8")
    except (UnicodeDecodeError, OSError):
      continue
    texts.append(text)
    size += len(text)
    if size >= max_bytes:
      break
  return "\n".join(texts)


def train_tokenizer(text: str, vocab_size: int) -> Tokenizer:
  """A byte-level BPE of ``vocab_size`` tokens trained on ``text``."""
  tokenizer = Tokenizer(models.BPE())
  tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tokenizer.decoder = decoders.ByteLevel()
  trainer = trainers.BpeTrainer(
    vocab_size=vocab_size,
    initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    show_progress=False,
  )
  lines = text.splitlines(keepends=True)
  tokenizer.train_from_iterator(
    ("".join(lines[i : i + 200]) for i in range(0, len(lines), 200)), trainer
  )
  return tokenizer


class Block(nnx.Module):
  def __init__(self, dim: int, heads: int, rngs: nnx.Rngs):
    self.norm1 = nnx.RMSNorm(dim, rngs=rngs)
    self.attn = nnx.MultiHeadAttention(
      num_heads=heads, in_features=dim, decode=False, rngs=rngs
    )
    self.norm2 = nnx.RMSNorm(dim, rngs=rngs)
    self.up = nnx.Linear(dim, 4 * dim, rngs=rngs)
    self.down = nnx.Linear(4 * dim, dim, rngs=rngs)

  def __call__(self, x, mask):
    x = x + self.attn(self.norm1(x), mask=mask)
    return x + self.down(jax.nn.gelu(self.up(self.norm2(x))))


class TinyLM(nnx.Module):
  """Token and position embeddings, pre-norm blocks, and a head.

  ``head="mst"`` uses ``mst_jax.LMHeadLoss`` (``chunk_size`` rows of logits
  at a time; None: its default); ``head="naive"`` a plain ``nnx.Linear`` to
  full logits and optax's cross-entropy, for comparison.
  """

  def __init__(self, vocab, dim, layers, heads, seq_len, head, chunk_size, rngs):
    self.embed = nnx.Embed(vocab, dim, rngs=rngs)
    self.position = nnx.Param(jax.random.normal(rngs.params(), (seq_len, dim)) * 0.02)
    self.blocks = nnx.List([Block(dim, heads, rngs) for _ in range(layers)])
    self.norm = nnx.RMSNorm(dim, rngs=rngs)
    self.head_kind = head
    if head == "mst":
      self.head = mst_jax.LMHeadLoss(dim, vocab, chunk_size=chunk_size, rngs=rngs)
    else:
      self.head = nnx.Linear(dim, vocab, use_bias=False, rngs=rngs)

  def hidden(self, tokens):
    seq_len = tokens.shape[1]
    x = self.embed(tokens) + self.position[:seq_len]
    mask = nnx.make_causal_mask(tokens)
    for block in self.blocks:
      x = block(x, mask)
    return self.norm(x)

  def loss(self, tokens):
    """Next-token loss on ``tokens`` ``[B, T]`` (position t predicts t + 1)."""
    hidden, labels = self.hidden(tokens)[:, :-1], tokens[:, 1:]
    if self.head_kind == "mst":
      return self.head(hidden, labels)
    logits = self.head(hidden).astype(jnp.float32)
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()


def batches(ids: np.ndarray, batch: int, seq_len: int, rng: np.random.Generator):
  while True:
    starts = rng.integers(0, len(ids) - seq_len - 1, batch)
    yield jnp.asarray(np.stack([ids[s : s + seq_len] for s in starts]))


def loss_memory_mib(model: TinyLM, tokens) -> float:
  """Compiled temporaries of the loss's value and gradients, in MiB."""
  graphdef, state = nnx.split(model)

  def loss(state, tokens):
    return nnx.merge(graphdef, state).loss(tokens)

  step = jax.jit(jax.value_and_grad(loss))
  return (
    step.lower(state, tokens).compile().memory_analysis().temp_size_in_bytes / 2**20
  )


def main(argv=None):
  parser = argparse.ArgumentParser(
    description=__doc__.split("\n\n")[0],
    formatter_class=argparse.ArgumentDefaultsHelpFormatter,
  )
  parser.add_argument("--steps", type=int, default=150, help="training steps")
  parser.add_argument("--seq-len", type=int, default=128, help="tokens per sequence")
  parser.add_argument("--batch", type=int, default=16, help="sequences per step")
  parser.add_argument(
    "--vocab-size", type=int, default=16384, help="BPE vocabulary to train"
  )
  parser.add_argument("--dim", type=int, default=128, help="model width D")
  parser.add_argument("--layers", type=int, default=2, help="transformer blocks")
  parser.add_argument("--heads", type=int, default=4, help="attention heads")
  parser.add_argument(
    "--chunk-size",
    type=int,
    default=256,
    help="rows of logits LMHeadLoss forms at a time (0: mst_jax's default, which"
    " chunks only logits larger than its memory budget)",
  )
  parser.add_argument("--lr", type=float, default=3e-3, help="peak AdamW rate")
  parser.add_argument(
    "--corpus-mib", type=float, default=4.0, help="MiB of stdlib source to read"
  )
  parser.add_argument("--seed", type=int, default=0, help="random seed")
  args = parser.parse_args(argv)
  if MISSING:
    print(
      f"this example needs {MISSING}, from the examples extra:"
      ' pip install -e ".[examples]"',
      file=sys.stderr,
    )
    raise SystemExit(2)

  device = jax.devices()[0]
  print(f"jax {jax.__version__} on {device.platform} ({device.device_kind})")
  start = time.perf_counter()
  text = load_corpus(int(args.corpus_mib * 2**20))
  tokenizer = train_tokenizer(text, args.vocab_size)
  ids = np.asarray(tokenizer.encode(text).ids, np.int32)
  vocab = tokenizer.get_vocab_size()
  print(
    f"corpus: {len(text) / 2**20:.1f} MiB of stdlib source -> {len(ids):,} tokens,"
    f" BPE vocabulary {vocab} ({time.perf_counter() - start:.0f} s)"
  )

  make = lambda head: TinyLM(
    vocab,
    args.dim,
    args.layers,
    args.heads,
    args.seq_len,
    head,
    args.chunk_size or None,
    nnx.Rngs(args.seed),
  )
  model = make("mst")
  optimizer = nnx.Optimizer(
    model, optax.adamw(optax.cosine_decay_schedule(args.lr, args.steps)), wrt=nnx.Param
  )

  @nnx.jit
  def train_step(model, optimizer, tokens):
    loss, grads = nnx.value_and_grad(lambda m: m.loss(tokens))(model)
    optimizer.update(model, grads)
    return loss

  data = batches(ids, args.batch, args.seq_len, np.random.default_rng(args.seed))
  losses = []
  with tqdm(range(args.steps), desc="train", unit="step") as progress:
    for step in progress:
      losses.append(float(train_step(model, optimizer, next(data))))
      if step % 10 == 0:
        progress.set_postfix(loss=f"{losses[-1]:.3f}")
  first, last = np.mean(losses[:10]), np.mean(losses[-10:])
  print(f"loss: first 10 steps {first:.3f} -> last 10 steps {last:.3f}")

  tokens = next(data)
  ours, naive = (
    loss_memory_mib(make("mst"), tokens),
    loss_memory_mib(make("naive"), tokens),
  )
  print(
    f"compiled memory of the loss's value and gradients, batch {args.batch} x"
    f" {args.seq_len}, V={vocab}: LMHeadLoss {ours:.1f} MiB, naive Linear head"
    f" {naive:.1f} MiB ({ours / naive:.2f}x)"
  )
  fell = last < first
  print(
    f"verdict: the loss {'fell' if fell else 'DID NOT fall'}, from {first:.3f}"
    f" (first 10 steps) to {last:.3f} (last 10)"
  )
  if not fell:
    raise SystemExit(1)


if __name__ == "__main__":
  main()
