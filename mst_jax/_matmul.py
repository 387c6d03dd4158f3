"""The LM head's three matmuls, for either weight layout.

The weight is ``[V, D]`` (``"vd"``: an embedding table, a torch
``lm_head.weight``) or ``[D, V]`` (``"dv"``: a Flax Dense kernel). Everything
that depends on the layout is here, so the rest of the package never
transposes (or copies) the weight.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

WEIGHT_LAYOUTS = ("vd", "dv")

# lax.dot_general dimension numbers per weight layout.
_LOGITS_DIMS = {  # hidden [C, D] x weight -> [C, V]
  "vd": (((1,), (1,)), ((), ())),
  "dv": (((1,), (0,)), ((), ())),
}
_DHIDDEN_DIMS = {  # dlogits [C, V] x weight -> [C, D]
  "vd": (((1,), (0,)), ((), ())),
  "dv": (((1,), (1,)), ((), ())),
}
_CONTRACT_ROWS = (((0,), (0,)), ((), ()))


def vocab_axis(layout: str) -> int:
  """The weight's vocabulary axis: 0 for ``"vd"``, 1 for ``"dv"``."""
  return 0 if layout == "vd" else 1


def vocab_size(weight: jax.Array, layout: str) -> int:
  """The number of vocabulary columns ``weight`` holds."""
  return weight.shape[vocab_axis(layout)]


def weight_columns(
  weight: jax.Array, start: jax.Array, size: int, layout: str
) -> jax.Array:
  """The weight's vocabulary columns ``[start, start + size)``, either layout."""
  return lax.dynamic_slice_in_dim(weight, start, size, axis=vocab_axis(layout))


def logits_matmul(
  hidden: jax.Array,
  weight: jax.Array,
  bias: jax.Array | None,
  layout: str,
  dtype: jnp.dtype | None = None,
) -> jax.Array:
  """``hidden @ weight (+ bias)`` in ``dtype`` (default: at least float32).

  ``dtype`` is what the matmul writes (with a bias, after adding it in float32:
  one rounding). For a narrower ``dtype`` the accumulation precision is the
  backend's: cuBLAS and XLA:CPU accumulate bfloat16 products in float32.
  """
  acc = jnp.promote_types(hidden.dtype, jnp.float32)
  dtype = dtype or acc
  if bias is None:
    return lax.dot_general(
      hidden, weight, _LOGITS_DIMS[layout], preferred_element_type=dtype
    )
  logits = lax.dot_general(
    hidden, weight, _LOGITS_DIMS[layout], preferred_element_type=acc
  )
  return (logits + bias.astype(acc)).astype(dtype)


def dhidden_matmul(
  dlogits: jax.Array, weight: jax.Array, layout: str, dtype: jnp.dtype
) -> jax.Array:
  """``dlogits @ weight`` written in ``dtype``.

  The matmul accumulates in float32 and rounds once to ``dtype``, as the naive
  head's backward pass does; asking for a float32 result and converting would
  hold a float32 ``[rows, D]`` temporary (and, where XLA splits the long
  vocabulary contraction, several).
  """
  return lax.dot_general(
    dlogits, weight, _DHIDDEN_DIMS[layout], preferred_element_type=dtype
  )


def dweight_matmul(
  dlogits: jax.Array, hidden: jax.Array, layout: str, dtype: jnp.dtype
) -> jax.Array:
  """The weight gradient of a block of rows, in the weight's layout, in ``dtype``."""
  # "vd": dlogits^T @ hidden -> [V, D]; "dv": hidden^T @ dlogits -> [D, V].
  operands = (dlogits, hidden) if layout == "vd" else (hidden, dlogits)
  return lax.dot_general(*operands, _CONTRACT_ROWS, preferred_element_type=dtype)
