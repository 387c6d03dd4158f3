"""Tiles and pipelining of the Mosaic GPU GEMM (``mosaic_gemm``), per shape.

``GemmConfig`` is the kernel's tuning; ``default_config`` picks one for a
product's shape (``_tuned``, measured on an H200) and fits it to shared
memory.
"""

from __future__ import annotations

import dataclasses
import math

import jax.numpy as jnp

SMEM_BYTES = 227 * 1024  # an sm_90 block's dynamic shared memory limit


@dataclasses.dataclass(frozen=True)
class GemmConfig:
  """Tiles and pipelining of the Mosaic GPU GEMM.

  Each of a block's two compute warpgroups holds a ``[tile_m, tile_n]``
  float32 accumulator in registers (``tile_m * tile_n / 128`` per thread).
  They split a ``[2 tile_m, tile_n]`` (``split="m"``) or ``[tile_m, 2
  tile_n]`` (``split="n"``) output tile, or (``split="tiles"``) take the
  block's ``[tile_m, tile_n]`` tiles in turn, one's epilogue overlapping the
  other's main loop (a "ping-pong" schedule).

  Attributes:
    tile_m: output rows per compute warpgroup, a multiple of 64.
    tile_n: output columns per compute warpgroup, a multiple of 64.
    tile_k: contraction step, a multiple of 64 (one 128-byte swizzle row).
    stages: shared-memory slots of the operand ring (TMA runs ahead by this);
      at least 2 with ``split="tiles"``.
    split: ``"m"``, ``"n"`` or ``"tiles"``: what the warpgroups split, an
      output tile's rows, its columns, or the block's tiles.
    grid_minor: ``"m"`` or ``"n"``: the fast dimension of the tile walk.
    grid_tile_width: output tiles per band of the snake along ``grid_minor``.
    epilogue_m: rows of each epilogue store, divides ``tile_m``.
    epilogue_n: columns of each epilogue store, divides ``tile_n``.
    epilogue_buffers: shared-memory slots per compute warpgroup for the
      epilogue's pieces (at most one per piece): with an ``accumulate``
      addend, how many of a tile's pieces load during the main loop.
    k_splits: contiguous parts of the contraction computed by separate
      blocks into float32 partial outputs that are then summed (split-K: a
      small output over a long contraction, e.g. ``dhidden`` of a few hundred
      rows, keeps every SM busy).
  """

  tile_m: int = 128
  tile_n: int = 128
  tile_k: int = 64
  stages: int = 4
  split: str = "m"
  grid_minor: str = "n"
  grid_tile_width: int = 8
  epilogue_m: int = 64
  epilogue_n: int = 64
  epilogue_buffers: int = 2
  k_splits: int = 1

  def __post_init__(self) -> None:
    def check(ok: bool, name: str, what: str) -> None:
      if not ok:
        raise ValueError(
          f"GemmConfig.{name} must be {what}, got {getattr(self, name)!r}."
        )

    for name in ("tile_m", "tile_n", "tile_k"):
      value = getattr(self, name)
      check(isinstance(value, int) and value > 0 and value % 64 == 0, name, "64 i")
    # 2 compute warpgroups x tile_m * tile_n / 128 float32 registers per thread.
    check(self.tile_m * self.tile_n <= 128 * 192, "tile_n", "<= 24576 / tile_m")
    for name, tile in (("epilogue_m", self.tile_m), ("epilogue_n", self.tile_n)):
      value = getattr(self, name)
      check(value % 8 == 0 and tile % value == 0, name, f"8 i dividing {tile}")
    check(self.split in ("m", "n", "tiles"), "split", "'m', 'n' or 'tiles'")
    check(self.grid_minor in ("m", "n"), "grid_minor", "'m' or 'n'")
    # Ping-pong frees a slot a step late (one wgmma left in flight).
    least_stages = 2 if self.split == "tiles" else 1
    check(self.stages >= least_stages, "stages", f">= {least_stages}")
    check(self.grid_tile_width >= 1, "grid_tile_width", ">= 1")
    check(self.k_splits >= 1, "k_splits", ">= 1")
    check(self.epilogue_buffers >= 1, "epilogue_buffers", ">= 1")

  @property
  def block_m(self) -> int:
    return self.tile_m * (2 if self.split == "m" else 1)

  @property
  def block_n(self) -> int:
    return self.tile_n * (2 if self.split == "n" else 1)

  def smem_bytes(
    self, in_dtype, out_dtype, accumulate: bool, row_vectors: int = 0
  ) -> int:
    """Shared memory the kernel allocates (operand ring + epilogue slots;
    split along K, the slots hold float32 partial products; ``row_vectors``:
    a row epilogue's inputs and outputs, a 4-byte ``[tile_m]`` buffer and a
    barrier each per compute warpgroup)."""
    if self.k_splits > 1:
      out_dtype = jnp.float32
    ring = self.stages * self.tile_k * (self.block_m + self.block_n)
    slots_per_wg = epilogue_slots(self)
    slots = 2 * slots_per_wg * self.epilogue_m * self.epilogue_n
    barriers = 8 * (3 * self.stages + 2 * slots_per_wg * accumulate + 2 * row_vectors)
    in_bytes, out_bytes = jnp.dtype(in_dtype).itemsize, jnp.dtype(out_dtype).itemsize
    rows = 2 * 4 * self.tile_m * row_vectors
    return ring * in_bytes + slots * out_bytes + barriers + rows


@dataclasses.dataclass(frozen=True)
class Problem:
  """The static shape of one call: ``out[m, n] = A[m, k] @ B[k, n]``."""

  m: int
  n: int
  k: int
  lhs_transposed: bool  # lhs is stored [k, m]
  rhs_transposed: bool  # rhs is stored [n, k]
  in_dtype: jnp.dtype
  out_dtype: jnp.dtype
  accumulate: bool
  # Whether the lhs, the rhs and the output, as stored, have a number of rows
  # that is not a multiple of 8 (such as a [50257, D] weight): TMA copies
  # those a row at a time (``_gemm.mosaic.kernels``).
  ragged: tuple[bool, bool, bool] = (False, False, False)
  # None, "m" or "k": a bound read from device memory cuts the output's rows
  # (tiles from it on are not computed) or the contraction (steps from its
  # tile_k step on are not taken).
  bounded: str | None = None


_SWIZZLE_SPAN = 128  # bytes: a shared-memory tile's row


def ragged_error(config: GemmConfig, p: Problem) -> str | None:
  """Why ``config`` cannot copy ``p``'s ragged arrays (``Problem.ragged``),
  or None.

  TMA copies such an array in tiles of one row. Where a shared-memory tile
  is one swizzle span (128 bytes) wide, it lays them out as it lays out
  tiles of 8 rows (row ``r`` at byte ``128 r``, swizzled by its address
  alike), so wgmma and the registers read them as usual. The ping-pong
  kernel, which writes its copies out, takes them.
  """
  lhs, rhs, out = p.ragged
  in_bytes, out_bytes = jnp.dtype(p.in_dtype).itemsize, _stored_bytes(config, p)
  if not any(p.ragged):
    return None
  if lhs and p.lhs_transposed:
    return "a ragged lhs contracted over its rows (stored [k, m])"
  if config.split != "tiles":
    return "ragged arrays need split='tiles'"
  if (lhs or rhs) and config.tile_k * in_bytes > _SWIZZLE_SPAN:
    return f"a ragged operand needs tile_k of at most {_SWIZZLE_SPAN} bytes"
  if rhs and not p.rhs_transposed and config.block_n * in_bytes > _SWIZZLE_SPAN:
    return f"a ragged rhs stored [k, n] needs tile_n of at most {_SWIZZLE_SPAN} bytes"
  if out and config.epilogue_n * out_bytes > _SWIZZLE_SPAN:
    return f"a ragged output needs epilogue_n of at most {_SWIZZLE_SPAN} bytes"
  return None


def _stored_bytes(config: GemmConfig, p: Problem) -> int:
  """Bytes per element the kernel stores: float32 partial products when
  split along K, else the output dtype's."""
  return 4 if config.k_splits > 1 else jnp.dtype(p.out_dtype).itemsize


def fit_ragged(config: GemmConfig, p: Problem) -> GemmConfig:
  """``config`` made to copy ``p``'s ragged arrays (``ragged_error``): ping-pong,
  64-element contraction steps, 256 x 64 tiles where the rhs is contracted
  over its ragged rows (a ``[V, D]`` weight in ``dhidden``), and epilogue
  pieces one swizzle span wide for a ragged output."""
  lhs, rhs, out = p.ragged
  if not any(p.ragged):
    return config
  in_elements = _SWIZZLE_SPAN // jnp.dtype(p.in_dtype).itemsize
  config = dataclasses.replace(config, split="tiles", tile_k=in_elements)
  if rhs and not p.rhs_transposed:
    tile_n = in_elements
    config = dataclasses.replace(config, tile_m=256, tile_n=tile_n, epilogue_n=tile_n)
  if out:
    out_elements = _SWIZZLE_SPAN // _stored_bytes(config, p)
    epilogue_n = min(config.epilogue_n, out_elements)
    config = dataclasses.replace(config, epilogue_n=epilogue_n)
  return config


def narrow_error(config: GemmConfig, p: Problem) -> str | None:
  """Why ``config`` cannot store ``p``'s output, or None: an output one
  swizzle span wide (a 16-bit ``[N, 64]`` ``dhidden`` or ``[V, 64]``
  ``dweight``) came out as zeros on the H200 when stored from blocks wider
  than it, so its blocks must be one span wide (docs/benchmarks.md)."""
  span = _SWIZZLE_SPAN // _stored_bytes(config, p)
  if p.n <= span and config.block_n > span:
    return f"an output of {p.n} columns needs blocks of at most {span} columns"
  return None


def fit_narrow(config: GemmConfig, p: Problem) -> GemmConfig:
  """``config`` with blocks one swizzle span wide where ``narrow_error``
  asks for them."""
  if narrow_error(config, p) is None:
    return config
  span = _SWIZZLE_SPAN // _stored_bytes(config, p)
  split = "m" if config.split == "n" else config.split
  epilogue_n = min(config.epilogue_n, span)
  return dataclasses.replace(config, tile_n=span, epilogue_n=epilogue_n, split=split)


def epilogue_slots(config: GemmConfig) -> int:
  """Epilogue staging slots per warpgroup: ``epilogue_buffers``, at most
  one per piece of the tile."""
  stores = (config.tile_m // config.epilogue_m) * (config.tile_n // config.epilogue_n)
  return min(config.epilogue_buffers, stores)


# Tuned on an H200 at the Llama-3 and Gemma-2 heads. A contraction of at
# least _LONG_K (dhidden, K = V; or a dweight over as many rows): three stages
# and 128 x 32 epilogue pieces (fewer round trips for an addend loaded ahead).
_LONG_K = 16384
_FEW_PIECES = GemmConfig(stages=3, epilogue_m=128, epilogue_n=32)
# ... or 128 x 192 blocks, taken where they fill the SMs' waves better than
# 256 x 128 (a chunk of 128 or 384 rows, Gemma-2's D = 2304 = 12 x 192).
_NARROW_LONG_K = GemmConfig(tile_m=64, tile_n=192, epilogue_n=32)
# A shorter contraction (logits, dweight): 128 x 192 tiles that the
# warpgroups take in turn, so one's epilogue overlaps the other's main loop.
# A short one (a chunk's dweight) leaves a tile little main loop to hide an
# epilogue behind. While an operand fits in L2 (_L2_ELEMENTS: a chunk's
# hidden or dlogits), the walk goes down the rows first, so the other (the
# weight, or a chunk's dlogits) is read from memory once.
_TURNS = GemmConfig(tile_n=192, stages=4, split="tiles")
_L2_ELEMENTS = 16 << 20  # 32 MiB of 16-bit elements, of the H200's 50 MB L2
# ... except the logits of a left operand larger than L2 (a whole group of
# rows): 256 x 192 blocks.
_WIDE = GemmConfig(tile_n=192, stages=3)
_VOCAB = 16384  # an output at least this wide is vocabulary-wide
# A 16-bit addend over a contraction of at most _SHORT_K (a small chunk's
# dweight +=): 128 x 128 tiles in two 64 x 128 epilogue pieces, each with its
# own slot, so the whole tile's addend loads during the main loop (4-8 steps,
# too short to hide the round trips of pieces loaded one after another).
_SHORT_K = 512
_ADDEND_AHEAD = dict(tile_n=128, epilogue_n=128)


def _tuned(m: int, n: int, k: int, out_dtype, accumulate: bool) -> GemmConfig:
  """The measured config for an ``[m, k] x [k, n]`` product's shape."""
  if accumulate and k <= _SHORT_K and jnp.dtype(out_dtype).itemsize == 2:
    return dataclasses.replace(_turns(m, n, k), **_ADDEND_AHEAD)
  if k >= _LONG_K:
    return _FEW_PIECES
  if n >= _VOCAB and m * k > _L2_ELEMENTS and not accumulate:
    return _WIDE
  return _turns(m, n, k)


def _turns(m: int, n: int, k: int) -> GemmConfig:
  """Ping-pong tiles, walked down the rows first while an operand fits L2."""
  if min(m, n) * k <= _L2_ELEMENTS:
    return dataclasses.replace(_TURNS, grid_minor="m")
  return _TURNS


# A split of the contraction takes at least this many tile_k steps; a split
# is taken when it fills the SMs' last wave of tiles better by this fraction;
# the float32 partial products take at most this many bytes.
_MIN_SPLIT_STEPS = 16
_SPLIT_GAIN = 0.05
_MAX_PARTIAL_BYTES = 128 << 20


def _fill(m: int, n: int, config: GemmConfig, num_sms: int) -> float:
  """The fraction of the blocks' waves that covers the output: padding past
  ``m`` and ``n`` and the last wave's idle SMs are lost."""
  parts = config.k_splits
  blocks = -(-m // config.block_m) * -(-n // config.block_n) * parts
  waves = -(-blocks // num_sms)
  return m * n * parts / (waves * num_sms * config.block_m * config.block_n)


def _k_splits(m: int, n: int, k: int, config: GemmConfig, num_sms: int) -> int:
  """Split-K factor: parts enough for the output tiles to fill the SMs.

  Fewer tiles than SMs: as many parts as fill one wave. Otherwise up to 4
  parts where they fill the last wave better (a ``[4096, 2304]`` output in
  256 x 128 tiles: 288 on 132 SMs leave the third wave 82% idle; 4 parts fill
  97%). Unlike ``_fill``, this counts whole tiles, not their padding.
  """
  tiles = -(-m // config.block_m) * -(-n // config.block_n)
  most = min(
    -(-k // config.tile_k) // _MIN_SPLIT_STEPS, _MAX_PARTIAL_BYTES // (4 * m * n)
  )
  if tiles < num_sms:
    return max(1, min(num_sms // tiles, most))
  filled = lambda parts: tiles * parts / (-(-tiles * parts // num_sms) * num_sms)
  best = 1
  for parts in range(2, min(4, most) + 1):
    if filled(parts) > filled(best) + _SPLIT_GAIN:
      best = parts
  return best


# Float32 accumulator elements per compute warpgroup. Under ``setmaxnreg``
# (232 registers for a compute thread) a 128 x 192 tile fits. jaxlib 0.12
# compiles Mosaic's PTX with libnvJitLink as relocatable code, where ptxas
# ignores ``setmaxnreg``: each of the block's 384 threads gets 168 registers,
# a 128 x 192 tile spills and its wgmmas run serialized (5x slower), and a
# 128 x 128 tile fits.
_ACCUMULATOR = 128 * 192
_ACCUMULATOR_RELOCATABLE = 128 * 128


def relocatable_ptx(jaxlib_version: str) -> bool:
  """Whether this jaxlib (0.12 on) compiles Mosaic's PTX as relocatable code,
  where ptxas ignores ``setmaxnreg``."""
  major, minor = (int(part) for part in jaxlib_version.split(".")[:2])
  return (major, minor) >= (0, 12)


def accumulator_limit(jaxlib_version: str) -> int:
  """Float32 accumulator elements a compute warpgroup may hold with this
  jaxlib (``_ACCUMULATOR_RELOCATABLE`` where ``relocatable_ptx``)."""
  return _ACCUMULATOR_RELOCATABLE if relocatable_ptx(jaxlib_version) else _ACCUMULATOR


def fit_registers(config: GemmConfig, limit: int, pingpong: bool = False) -> GemmConfig:
  """``config`` with tiles narrowed (``tile_n`` to a multiple of 64) until a
  compute warpgroup's accumulator holds at most ``limit`` elements.

  A ping-pong config so narrowed becomes cooperative (``split="m"``) unless
  ``pingpong`` (a row epilogue needs it): with 128 x 128 tiles, ping-pong ran
  the Llama-3 head's ``dweight`` in 13.7 ms and its logits (with the
  statistics epilogue) in 21.4 ms, cooperative ``[256, 128]`` blocks in 12.2
  and 11.9 ms (H100, jax 0.12.0.1).
  """
  if config.tile_m * config.tile_n <= limit:
    return config
  tile_n = max(64, limit // config.tile_m // 64 * 64)
  epilogue_n = math.gcd(config.epilogue_n, tile_n)
  split = "m" if config.split == "tiles" and not pingpong else config.split
  return dataclasses.replace(config, tile_n=tile_n, epilogue_n=epilogue_n, split=split)


def default_config(
  m: int,
  n: int,
  k: int,
  out_dtype,
  accumulate: bool,
  num_sms: int = 132,
  row_vectors: int | None = None,
  accumulator: int = _ACCUMULATOR,
) -> GemmConfig:
  """The config for an ``[m, k] x [k, n]`` product, fitted to shared memory.

  With ``row_vectors`` (a row epilogue's inputs and outputs), the product
  runs ping-pong (the only kernel with row epilogues) and unsplit.

  A float32 output's epilogue slots are narrowed to 32 columns, then stages
  dropped (to no fewer than 2), until they fit beside the operand ring. An
  output of fewer tiles than ``num_sms`` over a long contraction (not
  accumulated) is split along K. A long contraction (``dhidden``) takes
  128 x 192 blocks instead of ``_tuned``'s where they fill the SMs' waves
  ``_SPLIT_GAIN`` better (``_fill``; a split counts ``_SPLIT_GAIN`` worse).
  Tiles hold at most ``accumulator`` float32 elements a warpgroup
  (``accumulator_limit``; ``fit_registers``).
  """
  if row_vectors is not None:
    config = _turns(m, n, k)
  else:
    config = _tuned(m, n, k, out_dtype, accumulate)
  config = fit_registers(config, accumulator, pingpong=row_vectors is not None)
  if row_vectors is None and not accumulate:
    split = lambda c: dataclasses.replace(c, k_splits=_k_splits(m, n, k, c, num_sms))
    # A split costs its float32 partial products and their sum; blocks other
    # than _tuned's must fill the waves clearly better.
    tuned = split(config)
    score = lambda c: (
      _fill(m, n, c, num_sms) - _SPLIT_GAIN * ((c.k_splits > 1) + (c is not tuned))
    )
    narrow = fit_registers(_NARROW_LONG_K, accumulator)
    options = [tuned] + ([split(narrow)] if k >= _LONG_K else [])
    config = max(options, key=score)  # ties: _tuned's
  return fit_shared_memory(config, out_dtype, accumulate, row_vectors)


def fit_shared_memory(
  config: GemmConfig, out_dtype, accumulate: bool, row_vectors: int | None = None
) -> GemmConfig:
  """``config`` with its epilogue slots narrowed to 32 columns, then stages
  dropped (to no fewer than 2), until they fit beside the operand ring."""
  fits = lambda c: (
    c.smem_bytes(jnp.bfloat16, out_dtype, accumulate, row_vectors or 0) <= SMEM_BYTES
  )
  if not fits(config) and config.epilogue_n > 32:
    config = dataclasses.replace(config, epilogue_n=32)
  while not fits(config) and config.stages > 2:
    config = dataclasses.replace(config, stages=config.stages - 1)
  return config
