"""A head with a bias: the step's time and compiled temporaries.

``mst_jax.bench``'s cases have no bias; this times value-and-grad (hidden,
weight and bias) of one of them with a random ``[V]`` bias added, for the
naive head (bfloat16 logits plus the bias, cast to float32: a Flax
``Dense(use_bias=True)`` head before a float32 loss) and ``mst_jax`` specs
as the bench writes them, in the bench's rounds (the median over rounds of
each round's fastest step):

  python tools/bias_step.py --case gpt2 --impls naive_cast mst_jax \\
      mst_jax:impl=pallas --out bias.json

``--class-weights`` adds random ``[V]`` class weights (torch's ``weight``)
to every implementation, ``--no-bias`` leaves the bias out (``mst_jax``
specs may add ``label_smoothing=0.1``; the naive head has none).

Prints one row per implementation (ms, MiB of compiled temporaries) and
writes them to ``--out``.
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
from _steps import measure

import mst_jax
from mst_jax.bench.cases import CASES, make_inputs, parse_impl


def naive_loss(hidden, weight, bias, labels, where, classes, layout):
  product = hidden @ (weight.T if layout == "vd" else weight)
  logits = (product if bias is None else product + bias).astype(jnp.float32)
  lse = jax.nn.logsumexp(logits, axis=-1)
  target = jnp.take_along_axis(logits, labels[:, None], axis=-1)[:, 0]
  weights = where.astype(jnp.float32)
  if classes is not None:  # torch's weighted mean
    weights = weights * classes[labels]
  return jnp.sum(weights * (lse - target)) / jnp.maximum(jnp.sum(weights), 1e-30)


def make_step(spec: str, layout: str, biased: bool):
  name, kwargs = parse_impl(spec)

  def loss(hidden, weight, bias, labels, where, classes):
    if name == "naive_cast":
      return naive_loss(hidden, weight, bias, labels, where, classes, layout)
    return mst_jax.linear_cross_entropy(
      hidden,
      weight,
      labels,
      bias,
      where=where,
      class_weights=classes,
      weight_layout=layout,
      **kwargs,
    )

  argnums = (0, 1, 2) if biased else (0, 1)
  return jax.jit(jax.value_and_grad(loss, argnums=argnums))


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--case", default="gpt2", choices=sorted(CASES))
  parser.add_argument("--impls", nargs="+", default=["naive_cast", "mst_jax"])
  parser.add_argument("--reps", type=int, default=10)
  parser.add_argument("--rounds", type=int, default=3)
  parser.add_argument("--out", default=None)
  parser.add_argument("--class-weights", action="store_true")
  parser.add_argument("--no-bias", action="store_true")
  args = parser.parse_args(argv)
  case = CASES[args.case]
  hidden, weight, labels, where = make_inputs(case)
  bias = classes = None
  if not args.no_bias:
    bias = jax.random.normal(jax.random.key(1), (case.vocab,), hidden.dtype)
  if args.class_weights:
    classes = 2.0 * jax.random.uniform(jax.random.key(2), (case.vocab,))
  inputs = (hidden, weight, bias, labels, where, classes)
  steps = {}
  for spec in args.impls:
    steps[spec] = (make_step(spec, case.weight_layout, bias is not None), inputs)
  measure(case.name, steps, args.reps, args.rounds, args.out)


if __name__ == "__main__":
  main()
