"""A distillation step whose teacher is of another dtype than the student.

``mst_jax.bench``'s distillation cases give both heads the case's dtype;
this casts the teacher's hidden states and weight to ``--teacher-dtype``
(float16's logits are float32 by default) and times value-and-grad (the
student's hidden states and weight) of ``mst_jax`` specs as the bench writes
them, in the bench's rounds, beside the same step with both heads in the
case's dtype:

  python tools/distill_dtypes.py --case llama_distill --teacher-dtype float16

Prints one row per step (ms, MiB of compiled temporaries) and writes them
to ``--out``.
"""

from __future__ import annotations

import argparse

import jax
from _steps import measure

import mst_jax
from mst_jax.bench.cases import CASES, make_inputs, parse_impl


def make_step(spec: str, layout: str):
  _, kwargs = parse_impl(spec)

  def loss(hidden, weight, labels, where, teacher_hidden, teacher_weight):
    return mst_jax.linear_distillation_loss(
      hidden,
      weight,
      teacher_hidden,
      teacher_weight,
      labels,
      where=where,
      weight_layout=layout,
      **kwargs,
    )

  return jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--case", default="llama_distill")
  parser.add_argument("--teacher-dtype", default="float16")
  parser.add_argument("--impls", nargs="+", default=["mst_jax"])
  parser.add_argument("--reps", type=int, default=10)
  parser.add_argument("--rounds", type=int, default=3)
  parser.add_argument("--out", default=None)
  args = parser.parse_args(argv)
  case = CASES[args.case]
  *student, t_hidden, t_weight = make_inputs(case)
  teacher = [x.astype(args.teacher_dtype) for x in (t_hidden, t_weight)]
  inputs = {case.dtype: (*student, t_hidden, t_weight)}
  inputs[f"teacher {args.teacher_dtype}"] = (*student, *teacher)
  steps = {}
  for spec in args.impls:
    step = make_step(spec, case.weight_layout)
    for heads, arrays in inputs.items():
      steps[f"{spec} [{heads}]"] = (step, arrays)
  measure(case.name, steps, args.reps, args.rounds, args.out)


if __name__ == "__main__":
  main()
