"""Per-chunk cross-entropy backends behind one interface (``base.ChunkCE``)."""

from mst_jax.backends.base import ChunkCE
from mst_jax.backends.xla import XlaChunkCE

__all__ = ["ChunkCE", "XlaChunkCE"]
