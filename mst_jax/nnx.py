"""``LMHeadLoss`` for Flax NNX: an LM head whose call is its loss."""

from __future__ import annotations

import jax
import jax.numpy as jnp

try:
  from flax import nnx
  from flax.nnx.nn.linear import default_bias_init, default_kernel_init
except ModuleNotFoundError as error:
  raise ImportError("mst_jax.nnx needs Flax: pip install 'mst_jax[flax]'") from error

from mst_jax import _flax_head as head
from mst_jax._args.options import head_options


class LMHeadLoss(nnx.Module):
  """An LM head (``[D, V]`` kernel, like ``nnx.Linear``) that returns its loss.

  ``__call__`` computes the cross-entropy of the head's logits with
  ``mst_jax.linear_cross_entropy``, never forming the ``[tokens, V]`` logits;
  ``log_probs`` gives per-token log-probabilities and entropies
  (``mst_jax.linear_log_probs``, for RL) the same way; ``logits`` forms the
  logits, for evaluation and generation. The kernel is
  ``[in_features, vocab_size]`` like ``nnx.Linear``'s, so a checkpoint whose
  head is a Linear loads into it unchanged.

  Tied embeddings: pass ``embedding=`` an ``nnx.Embed`` (``[V, D]`` table) and
  the head uses that table, without copying or transposing it; the module
  holds a reference to the same Embed, so the table's gradient gets both the
  embedding lookup's and the head's contributions.

  Args:
    in_features: ``D``.
    vocab_size: ``V``.
    use_bias: add a ``[V]`` bias.
    dtype: computation dtype (None: inferred from inputs and parameters, as in
      ``nnx.Linear``); the loss is float32 whatever it is.
    param_dtype: dtype of the kernel and bias.
    kernel_init: initializer of the ``[D, V]`` kernel.
    bias_init: initializer of the bias.
    embedding: an ``nnx.Embed`` whose table is the head's weight (tied); then
      no kernel is created.
    rngs: the ``nnx.Rngs`` for parameter initialization.
    **options: the options of ``mst_jax.linear_cross_entropy`` (the fields of
      ``mst_jax.HeadLossOptions``: ``z_loss=1e-4``, ``chunk_size=1024``, ...),
      checked here.

  Example:

    >>> import jax, jax.numpy as jnp
    >>> from flax import nnx
    >>> import mst_jax
    >>> head = mst_jax.nnx.LMHeadLoss(64, 1000, rngs=nnx.Rngs(0))
    >>> head.kernel.shape
    (64, 1000)
    >>> hidden = jnp.ones((2, 16, 64))
    >>> labels = jnp.zeros((2, 16), jnp.int32)
    >>> head(hidden, labels).shape, head.logits(hidden).shape
    ((), (2, 16, 1000))
  """

  def __init__(
    self,
    in_features: int,
    vocab_size: int,
    *,
    use_bias: bool = False,
    dtype: jnp.dtype | None = None,
    param_dtype: jnp.dtype = jnp.float32,
    kernel_init: nnx.Initializer = default_kernel_init,
    bias_init: nnx.Initializer = default_bias_init,
    embedding: nnx.Embed | None = None,
    rngs: nnx.Rngs,
    **options,
  ):
    self.options = head_options("LMHeadLoss", options)
    if embedding is not None:
      table_shape = (embedding.num_embeddings, embedding.features)
      if table_shape != (vocab_size, in_features):
        raise ValueError(
          f"the tied embedding table is {table_shape}, but the head needs"
          f" (vocab_size, in_features) = {(vocab_size, in_features)}."
        )
      self.embedding = embedding
      self.kernel = nnx.data(None)
    else:
      self.embedding = nnx.data(None)
      self.kernel = nnx.Param(
        kernel_init(rngs.params(), (in_features, vocab_size), param_dtype)
      )
    if use_bias:
      self.bias = nnx.Param(bias_init(rngs.params(), (vocab_size,), param_dtype))
    else:
      self.bias = nnx.data(None)
    self.in_features = in_features
    self.vocab_size = vocab_size
    self.dtype = dtype
    self.param_dtype = param_dtype

  def _weight(self) -> head.HeadParams:
    bias = None if self.bias is None else self.bias[...]
    if self.embedding is not None:
      return head.HeadParams(self.embedding.embedding[...], "vd", bias)
    return head.HeadParams(self.kernel[...], "dv", bias)

  def __call__(
    self,
    hidden: jax.Array,
    labels: jax.Array,
    *,
    where: jax.Array | None = None,
    token_weights: jax.Array | None = None,
    class_weights: jax.Array | None = None,
    return_aux: bool = False,
  ):
    """The loss of ``hidden`` (``[..., T, D]``) against ``labels`` (``[..., T]``).

    ``where`` (bool) and ``token_weights`` (float, not differentiated) have
    the shape of ``labels``, ``class_weights`` (float, not differentiated)
    is ``[V]``; they act as in ``mst_jax.linear_cross_entropy``.
    Returns what ``mst_jax.linear_cross_entropy`` returns with this module's
    options: the float32 loss, and with ``return_aux`` a ``LossAux`` too.
    """
    return head.head_loss(
      self._weight(),
      hidden,
      labels,
      dtype=self.dtype,
      options=self.options,
      where=where,
      token_weights=token_weights,
      return_aux=return_aux,
      class_weights=class_weights,
    )

  def log_probs(
    self,
    hidden: jax.Array,
    labels: jax.Array,
    *,
    where: jax.Array | None = None,
    return_entropy: bool = False,
  ):
    """Each token's log-probability of its label (and, with ``return_entropy``,
    the entropy), as ``mst_jax.linear_log_probs`` with this module's options."""
    return head.head_log_probs(
      self._weight(),
      hidden,
      labels,
      dtype=self.dtype,
      options=self.options,
      where=where,
      return_entropy=return_entropy,
    )

  def logits(self, hidden: jax.Array) -> jax.Array:
    """Full logits ``[..., V]`` (scaled and softcapped like the loss's)."""
    return head.head_logits(
      self._weight(),
      hidden,
      dtype=self.dtype,
      options=self.options,
    )
