"""``python -m mst_jax.bench``: time and memory of the LM-head loss.

Every measurement is ``jax.value_and_grad`` of the loss with respect to the
hidden states and the weight (the hidden states only for a frozen head) under
``jax.jit``. Two baselines form the full [N, V] logits:
  naive       float32 logits straight from the matmul
              (preferred_element_type=float32)
  naive_cast  logits in the input dtype (e.g. bfloat16) cast to float32, as a
              Flax Dense(dtype=bfloat16) head feeding a float32 loss does
The ratios (time x, mem x) are against the faster of the two in each case.

Default run: on a GPU, the Llama-3-8B head (N=8192, D=4096, V=128256,
bfloat16) for naive_cast (there the faster naive head), mst_jax and the
installed peers (--full runs every GPU case); on a CPU, naive and mst_jax at
a narrow head with Qwen-2's vocabulary (N=4096, D=64, V=151936, float32),
whose 2.3 GiB of logits outgrow the default memory budget.

Time: the median over rounds of each round's fastest step. A round runs every
implementation of a case in turn (each round starting one later), --reps
steps each; there are at least --rounds rounds, and more while they disagree
by over 10%.
Memory (GPU): the step's peak device memory beyond its inputs and gradients,
in a fresh process per implementation that loads the step from a compilation
cache all of the run's processes share (so compilation is not counted); on a
CPU, the compiled step's temporaries.

Writes results.json and bench.png (time and extra memory) under --out.
Implementations are specs: naive, naive_cast, mst_jax (options after a colon,
e.g. mst_jax:grad_mode=recompute,chunk_size=1024), and the peers jax_cce and
tokamax where installed.
"""

from __future__ import annotations

import argparse
import inspect
from collections.abc import Sequence

import jax

import mst_jax
from mst_jax.bench import kernels, report
from mst_jax.bench.cases import CASES, parse_impl

HEADLINE_CASES = ["llama"]
GPU_CASES = [
  "llama",
  "gemma",
  "llama_32k",
  "llama_sft_prefix",
  "llama_sft_random",
  "llama_frozen",
]
# On a GPU naive_cast (a bfloat16 logits GEMM) is the faster naive head, the
# one the README's figures compare against; the default leaves naive out.
DEFAULT_IMPLS = ["naive_cast", "mst_jax", "jax_cce", "tokamax"]
IMPLEMENTATIONS = ["naive", *DEFAULT_IMPLS]  # every name a spec may have
# The CPU case's float32 logits (2.3 GiB) outgrow the default memory budget:
# the naive head holds them, mst_jax chunks them. Both naive heads are one on
# float32 inputs.
CPU_IMPLS = ["naive", "mst_jax"]


def parse_args(
  argv: Sequence[str] | None = None, on_gpu: bool | None = None
) -> argparse.Namespace:
  """Parses the command line; options left out get the device's defaults
  (``on_gpu``: whether they are a GPU's; default: whether jax runs on one)."""
  parser = argparse.ArgumentParser(
    prog="python -m mst_jax.bench",
    description=__doc__,
    epilog="cases:\n"
    + "\n".join(
      f"  {name:<17} {case.description}: {report.problem_line(case, brief=True)}"
      for name, case in sorted(CASES.items())
    ),
    formatter_class=argparse.RawDescriptionHelpFormatter,
  )
  parser.add_argument(
    "--full",
    action="store_true",
    help="on a GPU, every GPU case (" + ", ".join(GPU_CASES) + ") and the first"
    " call's peak, in place of the Llama-3 head alone (on a CPU, the default"
    " run is already the full one)",
  )
  parser.add_argument(
    "--cases",
    nargs="+",
    choices=sorted(CASES),
    default=None,
    metavar="CASE",
    help="named problem shapes, listed below (default: llama on a GPU, cpu on a CPU)",
  )
  parser.add_argument(
    "--tokens",
    nargs="+",
    type=_positive_int,
    default=None,
    help="sweep N over these values for every case (default: each case's own N)",
  )
  parser.add_argument(
    "--impls",
    nargs="+",
    type=_impl_spec,
    default=None,
    help="implementation specs (default on a GPU: "
    + " ".join(DEFAULT_IMPLS)
    + "; on a CPU: "
    + " ".join(CPU_IMPLS)
    + "; peers that are not installed are left out and listed)",
  )
  parser.add_argument(
    "--reps",
    type=_positive_int,
    default=None,
    help="timed steps per implementation per round (default: 10 on a GPU, 3 on a CPU)",
  )
  parser.add_argument(
    "--rounds",
    type=_positive_int,
    default=3,
    help="least number of timing rounds; up to 2 x ROUNDS + 1 are run while"
    " the rounds' fastest steps disagree by over 10%% (default: %(default)s)",
  )
  parser.add_argument(
    "--isolate",
    action=argparse.BooleanOptionalAction,
    default=None,
    help="measure in fresh processes: one that compiles and times a case, and"
    " one per implementation for memory (default on a GPU)",
  )
  parser.add_argument(
    "--memory",
    action=argparse.BooleanOptionalAction,
    default=None,
    help="peak-memory processes (needs --isolate and a GPU; default on a GPU)",
  )
  parser.add_argument(
    "--first-call",
    action=argparse.BooleanOptionalAction,
    default=None,
    help="also the first call's peak, compilation included: one more process"
    " per implementation (default with --full on a GPU)",
  )
  parser.add_argument(
    "--accuracy",
    action="store_true",
    help="also measure the gradients' error (the dh err and dw err columns)",
  )
  parser.add_argument("--out", default="bench_out", help="directory for JSON and plot")
  parser.add_argument(
    "--kernels",
    action="store_true",
    help="time the kernels alone: the CE kernels and the head GEMMs (GPU)",
  )
  parser.add_argument(
    "--kernel-groups",
    nargs="+",
    choices=["ce", "gemm"],
    default=["ce", "gemm"],
    help="with --kernels: the CE kernels, the head GEMMs (XLA vs Mosaic GPU)",
  )
  parser.add_argument(
    "--gemm-heads",
    nargs="+",
    choices=sorted(kernels.GEMM_HEADS),
    default=["llama", "gemma"],
    help="with --kernels: head shapes for the GEMMs (N, D, V)",
  )
  parser.add_argument(
    "--gemm-layouts", nargs="+", choices=["vd", "dv"], default=["vd", "dv"]
  )
  parser.add_argument(
    "--gemm-products",
    nargs="+",
    choices=["logits", "dhidden", "dweight"],
    default=["logits", "dhidden", "dweight"],
  )
  parser.add_argument(
    "--gemm-configs",
    nargs="*",
    default=[],
    help="with --kernels: extra Mosaic GemmConfigs to time, e.g. tile_n=192,stages=3",
  )
  parser.add_argument(
    "--chunk-shapes",
    nargs="+",
    default=["1024x128256", "4096x128256", "1024x256000", "4096x256000"],
    help="with --kernels: chunk shapes ROWSxV",
  )
  parser.add_argument(
    "--blocks",
    nargs="+",
    default=["1x2048x4"],
    help="with --kernels: Pallas KernelBlocks ROWSxBLOCK_VxWARPS[xSTAGES]",
  )
  parser.add_argument(
    "--logits-dtype",
    choices=["float32", "bfloat16"],
    default="float32",
    help="with --kernels: the chunk logits' dtype",
  )
  parser.add_argument(
    "--mosaic-tiles",
    nargs="*",
    default=[],
    help="with --kernels and bfloat16 logits: Mosaic GPU MosaicBlocks to time"
    " (Hopper), BLOCK_VxSTAGESxPROGRAMS, e.g. 128x2x1056",
  )
  parser.add_argument(
    "--fit",
    action="store_true",
    help="bisect the largest N that fits per case and impl (GPU)",
  )
  parser.add_argument(
    "--fit-granularity", type=_positive_int, default=8192, help="with --fit: N's step"
  )
  parser.add_argument(
    "--fit-confirm-attempts",
    type=_positive_int,
    default=6,
    help="with --fit: real steps tried (halving from the footprint N, then bisecting)",
  )
  parser.add_argument(
    "--fit-attempt-timeout",
    type=float,
    default=300,
    help="with --fit: seconds before a real step's process is killed (a failure)",
  )
  parser.add_argument(
    "--fit-from",
    type=int,
    default=None,
    help="with --fit: skip the compile-only bisection and confirm from this N",
  )
  parser.add_argument(
    "--fit-ran",
    type=int,
    default=0,
    help="with --fit: an N known to run (a failure then bisects towards it)",
  )
  parser.add_argument("--seed", type=int, default=0)
  args = parser.parse_args(argv)
  if args.fit_from and args.fit_ran >= args.fit_from:
    parser.error(f"--fit-ran {args.fit_ran} must be below --fit-from {args.fit_from}")
  on_gpu = jax.default_backend() == "gpu" if on_gpu is None else on_gpu
  small = args.chunk_shapes != parser.get_default("chunk_shapes")
  if args.kernels and not on_gpu and not (small and args.kernel_groups == ["ce"]):
    parser.error(
      "--kernels times the GPU kernels at LM-head sizes; this jax runs on a CPU,"
      " where they would run in interpret mode for hours (to try the CE kernels"
      " here: --kernel-groups ce --chunk-shapes 64x640)"
    )
  if (args.memory or args.first_call) and not on_gpu:
    parser.error(
      "--memory and --first-call read a GPU's peak memory (memory_stats());"
      " on a CPU the table's memory is the compiled program's temporaries"
    )
  _device_defaults(args, on_gpu)
  return args


def _positive_int(text: str) -> int:
  """An argparse type: an int of at least 1."""
  value = int(text)
  if value < 1:
    raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
  return value


def _impl_spec(spec: str) -> str:
  """An argparse type: an implementation spec whose name is known and, for
  ``mst_jax``, whose options its loss functions take."""
  name, kwargs = parse_impl(spec)
  if name not in IMPLEMENTATIONS:
    raise argparse.ArgumentTypeError(
      f"unknown implementation {name!r} (known: {', '.join(IMPLEMENTATIONS)})"
    )
  taken = set()
  for fn in (
    mst_jax.linear_cross_entropy,
    mst_jax.linear_log_probs,
    mst_jax.linear_distillation_loss,
  ):
    taken |= set(inspect.signature(fn).parameters)
  unknown = sorted(set(kwargs) - taken) if name == "mst_jax" else []
  if unknown:
    raise argparse.ArgumentTypeError(
      f"{spec!r}: mst_jax takes no option {', '.join(map(repr, unknown))}"
      " (its options are linear_cross_entropy's keywords)"
    )
  return spec


def _device_defaults(args: argparse.Namespace, on_gpu: bool) -> None:
  """Fills the options left out: a short run by default, all of it with --full."""
  if args.cases is None:
    args.cases = (GPU_CASES if args.full else HEADLINE_CASES) if on_gpu else ["cpu"]
  if args.impls is None:
    args.impls = DEFAULT_IMPLS if on_gpu else CPU_IMPLS
  if args.reps is None:
    args.reps = 10 if on_gpu else 3
  if args.isolate is None:
    args.isolate = on_gpu
  if args.memory is None:
    args.memory = on_gpu
  if args.first_call is None:
    args.first_call = args.full and on_gpu
  # Peak memory is read in fresh processes, from memory_stats() (a GPU's).
  args.memory = args.memory and args.isolate and on_gpu
  args.first_call = args.first_call and args.isolate and on_gpu
