"""The RL heads at one size: log-probs at K ids a position, and the top-k.

Times, in ``mst_jax.bench``'s rounds (the median over rounds of each round's
fastest step), at a bench case's shapes (default the Llama-3 head):

- ``log_probs``: value-and-grad (hidden, weight) of ``linear_log_probs`` at one
  label a position and its entropy, summed against fixed cotangents (the
  bench's ``llama_logprobs``);
- ``ids_K``: the same with ``K`` ids a position (labels ``[N, K]``), each
  ``--ids`` value;
- ``naive_ids_K``: a naive head's (bfloat16 logits cast to float32, then
  ``log_softmax`` taken at the ids) value-and-grad;
- ``top_k``: ``linear_top_k`` (k = ``--k``), forward only, against
  ``naive_top_k``: the naive head's logits, ``log_softmax`` and ``lax.top_k``.

  python tools/rl_heads.py --ids 1 64 --k 64 --out rl.json
  python tools/rl_heads.py --case cpu --tokens 512 --reps 1 --rounds 1  # a CPU

Prints one row per step (ms, MiB of compiled temporaries) and writes them to
``--out``.
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
from _steps import measure

import mst_jax
from mst_jax.bench.cases import CASES, make_inputs


def _weights(n: int, k: int):
  """Fixed pseudo-random cotangents of ``[n, k]`` log-probs."""
  return jax.random.uniform(jax.random.key(1), (n, k), jnp.float32, -1.0, 1.0)


def naive_log_softmax(hidden, weight):
  return jax.nn.log_softmax((hidden @ weight.T).astype(jnp.float32), axis=-1)


def steps(hidden, weight, labels, where, ids: list[int], k: int) -> dict:
  """Name -> ``(jitted step, args)`` of the heads the docstring lists."""
  n, v = hidden.shape[0], weight.shape[0]
  grad = lambda f: jax.jit(jax.value_and_grad(f, argnums=(0, 1)))
  out = {}

  def one_label(h, w):
    lp, ent = mst_jax.linear_log_probs(h, w, labels, where=where, return_entropy=True)
    c = _weights(n, 2)
    return jnp.sum(lp * c[:, 0] + ent * c[:, 1])

  out["log_probs"] = (grad(one_label), (hidden, weight))
  for count in ids:
    many = jax.random.randint(jax.random.key(count), (n, count), 0, v)
    c = _weights(n, count)

    def selected(h, w, many=many, c=c):
      return jnp.sum(mst_jax.linear_log_probs(h, w, many, where=where) * c)

    def naive(h, w, many=many, c=c):
      lp = jnp.take_along_axis(naive_log_softmax(h, w), many, axis=-1)
      return jnp.sum(jnp.where(where[:, None], lp, 0.0) * c)

    out[f"ids_{count}"] = (grad(selected), (hidden, weight))
    out[f"naive_ids_{count}"] = (grad(naive), (hidden, weight))
  top = lambda h, w: mst_jax.linear_top_k(h, w, k)
  naive_top = lambda h, w: jax.lax.top_k(naive_log_softmax(h, w), k)
  out["top_k"] = (jax.jit(top), (hidden, weight))
  out["naive_top_k"] = (jax.jit(naive_top), (hidden, weight))
  return out


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--case", default="llama", choices=sorted(CASES))
  parser.add_argument("--tokens", type=int, help="N (default: the case's)")
  parser.add_argument("--ids", type=int, nargs="+", default=[1, 64])
  parser.add_argument("--k", type=int, default=64)
  parser.add_argument("--reps", type=int, default=10)
  parser.add_argument("--rounds", type=int, default=3)
  parser.add_argument("--out", default=None)
  args = parser.parse_args()
  case = CASES[args.case]
  if args.tokens:
    case = case.with_tokens(args.tokens)
  hidden, weight, labels, where = make_inputs(case)[:4]
  chosen = steps(hidden, weight, labels, where, args.ids, args.k)
  measure(case.name, chosen, args.reps, args.rounds, args.out)


if __name__ == "__main__":
  main()
