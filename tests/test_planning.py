"""Chunk planning from a memory budget."""

from __future__ import annotations

import functools

import numpy as np
import pytest

from mst_jax import _plan


@pytest.mark.parametrize("n_rows", [1, 37, 1000, 2048, 8192, 32768, 100_000])
@pytest.mark.parametrize("vocab", [1031, 32000, 128256, 256000])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("budget", [2**20, 2**27, 2**31])
def test_plan_fits_budget_and_tiles_rows(n_rows, vocab, dtype, budget):
  dtype = np.dtype(dtype)
  chunk, group = _plan.plan_chunks(n_rows, vocab, dtype, memory_budget=budget)
  assert 1 <= chunk <= group <= n_rows
  assert group % chunk == 0 or group == n_rows
  itemsize = dtype.itemsize
  smallest = min(n_rows, 8)  # below one aligned chunk the budget cannot hold
  if chunk > smallest:
    capped = min(budget, n_rows * vocab * itemsize)
    group_bytes = (group if group > chunk else 0) * vocab * itemsize
    assert chunk * vocab * 4 + group_bytes <= capped


@pytest.mark.parametrize("n_rows", [1, 37, 1000, 2048, 8192, 32768, 100_000])
@pytest.mark.parametrize("vocab", [1031, 128256, 256000])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("budget", [2**20, 2**27, 2**31])
def test_in_place_plan_fits_budget_with_even_groups(n_rows, vocab, dtype, budget):
  """Logits in the compute dtype: as few, even groups as fit, in eighths."""
  dtype = np.dtype(dtype)
  chunk, group = _plan.plan_chunks(
    n_rows, vocab, dtype, memory_budget=budget, logits_dtype=dtype
  )
  assert 1 <= chunk <= group <= n_rows
  # A group's logits and one chunk's (a partially valid group's) fit.
  if group > min(n_rows, 8):
    assert (group + chunk) * vocab * dtype.itemsize <= budget
  # Eighths, rounded up to multiples of 8 rows.
  assert chunk == group or (chunk % 8 == 0 and chunk - 8 < group / 8 <= chunk)
  if group < n_rows:
    most = int(budget // (dtype.itemsize * vocab * 1.125))
    align = 128 if most >= 128 else 8
    largest = max(8, most // align * align)  # the largest aligned group that fits
    fewest, n_groups = -(-n_rows // largest), -(-n_rows // group)
    assert group % (128 if group >= 128 else 8) == 0
    assert group < -(-n_rows // n_groups) + align  # even, up to the alignment
    # As few groups as fit, unless up to twice as many overlap less.
    assert fewest <= n_groups <= 2 * fewest
    if n_groups > fewest:
      assert n_groups * group - n_rows < fewest * largest - n_rows


def test_plan_for_the_benchmark_heads():
  bf16 = np.dtype("bfloat16")
  in_place = lambda n, v, **kw: _plan.plan_chunks(n, v, bf16, logits_dtype=bf16, **kw)
  assert in_place(8192, 128256) == (1024, 8192)  # the whole batch in 2.25 GiB
  assert in_place(32768, 128256) == (1024, 8192)  # four even groups
  assert in_place(8192, 256000) == (512, 4096)
  assert _plan.plan_chunks(8192, 128256, bf16) == (1024, 4096)  # 2 whole groups
  # float32 logits: 2 groups + one of 2 chunks (3584 + 3584 + 1024).
  assert _plan.plan_chunks(8192, 256000, bf16) == (512, 3584)
  assert _plan.plan_chunks(2048, 128256, bf16) == (
    256,
    1024,
  )  # small N, small budget


def test_logits_of_another_16_bit_type_are_not_planned_in_place():
  """float16 inputs with bfloat16 logits: the sweep cannot write dlogits over
  the logits (different dtypes), so the plan is the float32-logits one."""
  f16, bf16 = np.dtype("float16"), np.dtype("bfloat16")
  other = _plan.plan_chunks(8192, 128256, f16, logits_dtype=bf16)
  assert other == _plan.plan_chunks(8192, 128256, f16)
  assert other != _plan.plan_chunks(8192, 128256, f16, logits_dtype=f16)


BF16 = np.dtype("bfloat16")


@pytest.mark.parametrize("n_rows", [8192, 16384, 32768, 131072])
@pytest.mark.parametrize("vocab,dim", [(128256, 4096), (256000, 2304), (32000, 4096)])
@pytest.mark.parametrize("budget", [2**29, 2**30, _plan.DEFAULT_MEMORY_BUDGET])
@pytest.mark.parametrize("cpu", [False, True])
def test_accumulator_plans_fit_the_budget(n_rows, vocab, dim, budget, cpu):
  """A float32 ``dweight`` accumulator is planned only where it and the
  groups' logits fit the budget: off the CPU counting only its bytes beyond
  the bfloat16 output (whose buffer XLA lends other temporaries until the
  last cast writes it), on the CPU all of them."""
  chunk, group, accum = _plan.plan_with_accumulator(
    n_rows, vocab, dim, BF16, BF16, memory_budget=budget, logits_dtype=BF16, cpu=cpu
  )
  n_groups = -(-n_rows // group)
  accumulator = 4 * vocab * dim
  counted = accumulator - (0 if cpu else 2 * vocab * dim)
  tile = _plan.matmul_tile("cpu", vocab, dim, budget) or vocab
  fixed = _plan.cpu_fixed_bytes(n_rows, dim, BF16, tile) if cpu else 0
  rest = max(budget - fixed, budget // 4)
  fits = accumulator <= rest and counted <= rest // 2
  if accum is None:  # in place: few groups, or no room for an accumulator
    assert n_groups <= _plan.MAX_GROUPS_IN_PLACE or not fits
    return
  assert accum == np.float32 and n_groups > _plan.MAX_GROUPS_IN_PLACE
  assert fits  # at the last cast, beside the output
  if not cpu and group > 8:
    assert counted + (group + chunk) * vocab * 2 <= budget


def test_llama_head_at_32768_tokens_takes_a_float32_accumulator():
  """The H200 measurement behind the rule (docs/benchmarks.md): at
  the default budget, eight groups of 4096 rows beside a float32 dweight took
  2110 MiB extra and matched the naive head's dweight error (four groups
  rounding a bfloat16 dweight in place: 1.38x it); on the CPU, in place."""
  plan = lambda cpu: _plan.plan_with_accumulator(
    32768,
    128256,
    4096,
    BF16,
    BF16,
    memory_budget=_plan.DEFAULT_MEMORY_BUDGET,
    logits_dtype=BF16,
    cpu=cpu,
  )
  assert plan(cpu=False) == (512, 4096, np.float32)
  assert plan(cpu=True)[2] is None


@pytest.mark.parametrize(
  "beside, per_logit", [("biased", _plan.BIAS_BYTES), ("dlogits_apart", 2)]
)
@pytest.mark.parametrize("n_rows", [8192, 32768])
@pytest.mark.parametrize("vocab", [50257, 128256])
@pytest.mark.parametrize("budget", [2**28, 2**30, _plan.DEFAULT_MEMORY_BUDGET])
def test_what_a_group_holds_beside_its_logits_fits_the_budget(
  beside, per_logit, n_rows, vocab, budget
):
  """A bias's float32 product (16-bit logits are rounded from it), or
  ``dlogits`` written beside the logits (XLA's cross-entropy on a GPU): a
  group's logits and that, a chunk's logits and a float32 accumulator's
  bytes beyond the output fit the budget (without either, the logits alone
  may take all of it). float32 logits of bfloat16 inputs plan the same with
  or without: the product is the logits, and their dlogits are apart anyway."""
  plan = functools.partial(
    _plan.plan_with_accumulator,
    n_rows,
    vocab,
    1600,
    BF16,
    BF16,
    memory_budget=budget,
    logits_dtype=BF16,
  )
  chunk, group, accum = plan(**{beside: True})
  _, plain_group, _ = plan()
  assert group < plain_group or group == n_rows
  accumulator = 0 if accum is None else 2 * vocab * 1600
  assert accumulator + (group * (2 + per_logit) + chunk * 2) * vocab <= budget
  f32 = dict(logits_dtype=np.dtype(np.float32))
  assert plan(**{beside: True}, **f32) == plan(**f32)


@pytest.mark.parametrize(
  "platform, impl, apart",
  [("gpu", "xla", True), ("gpu", "pallas", False), ("cpu", "xla", False)],
)
def test_xlas_cross_entropy_off_the_cpu_plans_dlogits_apart(
  monkeypatch, platform, impl, apart
):
  """The planner counts a group's dlogits beside its logits for XLA's
  cross-entropy off the CPU only (the Triton kernels write them in place; on
  the CPU its float32 copy is counted instead)."""
  import jax
  import jax.numpy as jnp

  import mst_jax
  from mst_jax import _kernels
  from mst_jax._losses import cross_entropy

  asked, loop_order = [], cross_entropy._loop_order

  def recording(*args, **kwargs):
    asked.append(kwargs["dlogits_apart"])
    return loop_order(*args, **kwargs)

  monkeypatch.setattr(cross_entropy, "_loop_order", recording)
  monkeypatch.setattr(cross_entropy, "_platform", lambda layout: platform)
  monkeypatch.setattr(_kernels, "pallas_unavailable_reason", lambda platform: None)
  hidden = jax.ShapeDtypeStruct((40, 16), jnp.bfloat16)
  weight = jax.ShapeDtypeStruct((100, 16), jnp.bfloat16)
  labels = jax.ShapeDtypeStruct((40,), jnp.int32)
  loss = lambda h, w, y: mst_jax.linear_cross_entropy(h, w, y, impl=impl)
  jax.clear_caches()  # traced again under the patches, and not kept after
  jax.eval_shape(loss, hidden, weight, labels)
  jax.clear_caches()
  assert asked == [apart]


@pytest.mark.parametrize("budget", [2**28, _plan.DEFAULT_MEMORY_BUDGET])
@pytest.mark.parametrize("vocab, dim", [(128256, 4096), (151552, 64), (32000, 1024)])
def test_cpu_matmuls_are_tiled_where_whole_weight_copies_outgrow_the_budget(
  budget, vocab, dim
):
  """On XLA:CPU the matmuls go in column tiles exactly where two float32
  ``[V, D]`` temporaries would take over an eighth of the budget; never
  elsewhere."""
  whole = 2 * 4 * vocab * dim
  tile = _plan.matmul_tile("cpu", vocab, dim, budget)
  assert tile == (_plan.MATMUL_TILE if whole * _plan.UNTILED_SHARE > budget else None)
  assert _plan.matmul_tile("gpu", vocab, dim, budget) is None
