"""``LMHeadLoss`` for Flax Linen: an LM head whose call is its loss."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

try:
  import flax.linen as nn
  from flax.linen.linear import default_kernel_init
except ModuleNotFoundError as error:
  raise ImportError("mst_jax.linen needs Flax: pip install 'mst_jax[flax]'") from error

from mst_jax import _flax_head as head
from mst_jax._args.options import HeadLossOptions, head_options


class LMHeadLoss(nn.Module):
  """An LM head (``[D, V]`` ``kernel``, like ``nn.Dense``) that returns its loss.

  ``__call__`` computes the cross-entropy of the head's logits with
  ``mst_jax.linear_cross_entropy``, never forming the ``[tokens, V]`` logits;
  ``logits`` forms them, for evaluation and generation. Its parameters are
  ``kernel`` (``[D, V]``) and ``bias`` like ``nn.Dense(vocab_size)``'s, so a
  checkpoint whose head is a Dense loads into it unchanged.

  Tied embeddings: pass an ``nn.Embed``'s table (``[V, D]``, e.g.
  ``self.embed.embedding`` inside your model) as ``embedding=`` to either call;
  the head then uses it (no kernel is created, nothing is copied), and the
  table's gradient gets both the lookup's and the head's contributions.

  Attributes:
    vocab_size: ``V``.
    use_bias: add a ``[V]`` bias.
    dtype: computation dtype (None: inferred, as in ``nn.Dense``); the loss is
      float32 whatever it is.
    param_dtype: dtype of the kernel and bias.
    kernel_init: initializer of the ``[D, V]`` kernel.
    bias_init: initializer of the bias.
    options: the loss options (``mst_jax.HeadLossOptions``); or give them
      one by one through ``LMHeadLoss.create``.

  Example:

    >>> import jax, jax.numpy as jnp
    >>> import mst_jax
    >>> head = mst_jax.linen.LMHeadLoss.create(1000, z_loss=1e-4)
    >>> hidden = jnp.ones((2, 16, 64))
    >>> labels = jnp.zeros((2, 16), jnp.int32)
    >>> params = head.init(jax.random.key(0), hidden, labels)
    >>> jax.tree.map(jnp.shape, params)
    {'params': {'kernel': (64, 1000)}}
    >>> head.apply(params, hidden, method="logits").shape
    (2, 16, 1000)
  """

  vocab_size: int
  use_bias: bool = False
  dtype: jnp.dtype | None = None
  param_dtype: jnp.dtype = jnp.float32
  kernel_init: nn.initializers.Initializer = default_kernel_init
  bias_init: nn.initializers.Initializer = nn.initializers.zeros_init()
  options: HeadLossOptions = HeadLossOptions()

  @classmethod
  def create(cls, vocab_size: int, **kwargs) -> LMHeadLoss:
    """``LMHeadLoss`` with loss options given as keywords (``z_loss=...``)."""
    fields = {f.name for f in dataclasses.fields(cls)}
    options = {k: kwargs.pop(k) for k in list(kwargs) if k not in fields}
    options = head_options("LMHeadLoss.create()", options, also=sorted(fields))
    return cls(vocab_size, options=options, **kwargs)

  @nn.compact
  def _weight(self, in_features: int, embedding: jax.Array | None):
    bias = None
    if self.use_bias:
      bias = self.param("bias", self.bias_init, (self.vocab_size,), self.param_dtype)
    if embedding is not None:
      if embedding.shape != (self.vocab_size, in_features):
        raise ValueError(
          f"the tied embedding table is {embedding.shape}, but the head needs"
          f" (vocab_size, in_features) = {(self.vocab_size, in_features)}."
        )
      return head.HeadParams(embedding, "vd", bias)
    kernel = self.param(
      "kernel", self.kernel_init, (in_features, self.vocab_size), self.param_dtype
    )
    return head.HeadParams(kernel, "dv", bias)

  def __call__(
    self,
    hidden: jax.Array,
    labels: jax.Array,
    *,
    where: jax.Array | None = None,
    token_weights: jax.Array | None = None,
    class_weights: jax.Array | None = None,
    return_aux: bool = False,
    embedding: jax.Array | None = None,
  ):
    """The loss of ``hidden`` (``[..., T, D]``) against ``labels`` (``[..., T]``).

    ``where`` (bool) and ``token_weights`` (float, not differentiated) have
    the shape of ``labels``, ``class_weights`` (float, not differentiated)
    is ``[V]``; they act as in ``mst_jax.linear_cross_entropy``.
    Returns what ``mst_jax.linear_cross_entropy`` returns with this module's
    options: the float32 loss, and with ``return_aux`` a ``LossAux`` too.
    """
    return head.head_loss(
      self._weight(hidden.shape[-1], embedding),
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
    embedding: jax.Array | None = None,
  ):
    """Each token's log-probability of its label (and, with ``return_entropy``,
    the entropy), as ``mst_jax.linear_log_probs`` with this module's options."""
    return head.head_log_probs(
      self._weight(hidden.shape[-1], embedding),
      hidden,
      labels,
      dtype=self.dtype,
      options=self.options,
      where=where,
      return_entropy=return_entropy,
    )

  def logits(self, hidden: jax.Array, *, embedding: jax.Array | None = None):
    """Full logits ``[..., V]`` (scaled and softcapped like the loss's)."""
    return head.head_logits(
      self._weight(hidden.shape[-1], embedding),
      hidden,
      dtype=self.dtype,
      options=self.options,
    )
