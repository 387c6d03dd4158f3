"""Values inside a caller's ``jax.shard_map`` that checks manual axes.

Inside ``jax.shard_map(..., check_vma=True)`` (JAX's default) each value's
type records the manual mesh axes over which it varies. A ``lax.scan`` carry
must keep its type through the body, the branches of a ``lax.cond`` must
agree, and a custom VJP's cotangents must have its inputs' types, while a
fresh constant (the zeros a loop starts from) varies over no axis.

``common`` casts the loss's inputs to vary over every axis any of them
varies over; the cast's transpose sums over the axes an input did not vary
over, so the gradient of a weight that is the same on every device is summed
over the devices, as autodiff of a naive head inside the same ``shard_map``
sums it. ``like`` casts a fresh constant to vary as a given input does.
Outside such a ``shard_map`` (or with ``check_vma=False``) no value varies
and both return their argument.
"""

from __future__ import annotations

from collections.abc import Iterable

import jax
from jax import lax


def axes(x) -> frozenset:
  """The manual axes ``x`` varies over (empty outside a checking ``shard_map``)."""
  aval = jax.typeof(x)
  varying = getattr(aval, "vma", None)
  if varying is None:
    mat = getattr(aval, "manual_axis_type", None)
    varying = frozenset() if mat is None else mat.varying
  return frozenset(varying)


def _cast(x, to: Iterable):
  missing = tuple(sorted(set(to) - axes(x), key=str))
  return lax.pcast(x, missing, to="varying") if missing else x


def _arrays(tree) -> list:
  return [x for x in jax.tree.leaves(tree) if isinstance(x, jax.Array)]


def common(tree):
  """``tree`` with each array cast to vary over the union of their axes."""
  union = frozenset().union(*map(axes, _arrays(tree)))
  if not union:
    return tree
  cast = lambda x: _cast(x, union) if isinstance(x, jax.Array) else x
  return jax.tree.map(cast, tree)


def like(tree, reference):
  """``tree``'s arrays cast to vary over (at least) ``reference``'s axes."""
  union = frozenset().union(*map(axes, _arrays(reference)))
  if not union:
    return tree
  return jax.tree.map(lambda x: _cast(x, union), tree)
