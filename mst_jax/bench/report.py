"""The benchmark's table and plot, from result rows (see ``cli``)."""

from __future__ import annotations

import textwrap
from collections.abc import Sequence

from mst_jax.bench.cases import Case

# Peers: implementation name -> the module it needs.
PEERS = {"jax_cce": "jax_cce", "tokamax": "tokamax"}

BASELINE_NOTE = (
  "time x and mem x are against the faster naive head of each case: naive"
  " (float32 logits straight from the matmul) or naive_cast (logits in the input"
  " dtype, e.g. bfloat16, cast to float32). Both form the full [N, V] logits."
)
STATISTIC_NOTE = (
  "time ms: the median over rounds of each round's fastest step. A round times"
  " every implementation of the case in turn ({reps} each), each round starting"
  " one later; there are at least"
  " {rounds}, and more (up to {max_rounds} rounds) while the rounds disagree by"
  " over 10%. spread: the slowest round's fastest step over the fastest round's."
  " compile s: jit(...).lower(...).compile() of the step in the timing process"
  " (XLA's autotuning included; the first implementation there also pays for"
  " JAX's own warm-up). time x and mem x: ratios against the naive head, lower"
  " is better."
)
MEMORY_NOTES = {
  "compiled temp": "extra MiB: the compiled step's temporaries (XLA's"
  " memory_analysis; a CPU reports no peak memory).",
  "peak": "extra MiB: the step's peak device memory beyond its inputs and"
  " gradients, measured in a fresh process that loads the compiled step.",
}
FIRST_CALL_NOTE = (
  "1st MiB: the same for the first call of a fresh process, which compiles"
  " (GEMM autotuning included)."
)
ACCURACY_NOTE = (
  "dh err, dw err: relative error of dhidden and dweight against float32 logits"
  " at HIGHEST matmul precision."
)


def problem(case: Case) -> dict:
  """The row fields that say what problem ``case`` is."""
  return {
    "description": case.description,
    "dim": case.dim,
    "vocab": case.vocab,
    "dtype": case.dtype,
    "weight_layout": "[D, V]" if case.weight_layout == "dv" else "[V, D]",
    "problem": problem_line(case),
  }


def problem_line(case: Case, *, brief: bool = False) -> str:
  """``N=... D=... V=... dtype, weight [V, D], ...``: what ``case`` computes.

  ``brief`` leaves out what every case shares (the weight layout, gradients
  of both inputs).
  """
  parts = [f"N={case.tokens:,} D={case.dim:,} V={case.vocab:,} {case.dtype}"]
  if not brief or case.weight_layout == "dv":
    parts.append("weight [D, V]" if case.weight_layout == "dv" else "weight [V, D]")
  if case.wrt != "hidden_weight":
    parts.append("gradient of hidden only (frozen head)")
  elif not brief:
    parts.append("gradients of hidden and weight")
  if case.mask == "prefix":
    parts.append(
      f"first {case.masked_fraction:.0%} of each {case.seq_len}-token sequence masked"
    )
  elif case.mask == "random":
    parts.append(f"{case.masked_fraction:.0%} of tokens masked at random")
  if case.objective == "distill":
    parts.append(f"forward KL from a teacher head of D={case.teacher_dim:,}")
  elif case.objective == "log_probs":
    parts.append("per-token log-probs and entropy")
  if case.parallel:
    parts.append(f"{case.devices} devices, {case.parallel} parallel")
  return ", ".join(parts)


def _cell(row: dict, key: str, spec: str, scale: float = 1.0) -> str:
  value = row.get(key)
  return "-" if value is None else format(value / scale, spec)


def _columns(rows: Sequence[dict]) -> list[tuple[str, str, str, float]]:
  """(header, row key, format, scale) of the columns that have values."""
  columns = [
    ("time ms", "time_ms", ".2f", 1.0),
    ("spread", "spread", ".2f", 1.0),
    ("compile s", "compile_s", ".1f", 1.0),
    ("extra MiB", "extra_bytes", ".0f", 2**20),
    ("1st MiB", "first_call_extra_bytes", ".0f", 2**20),
    ("TFLOP/s", "tflops", ".2f", 1.0),
    ("time x", "time_x", ".2f", 1.0),
    ("mem x", "mem_x", ".3f", 1.0),
    ("dh err", "dhidden_rel_err", ".1e", 1.0),
    ("dw err", "dweight_rel_err", ".1e", 1.0),
  ]
  return [c for c in columns if any(r.get(c[1]) is not None for r in rows)]


def _case_block(name: str, rows: list[dict]) -> list[str]:
  first = rows[0]
  what = ": ".join(x for x in (first.get("description"), first.get("problem")) if x)
  lines = [f"{name}: {what}"]
  measured = [r for r in rows if "time_ms" in r]
  base = next((r["baseline"] for r in measured if "baseline" in r), None)
  if measured:
    width = max(len(r["impl"]) for r in measured) + 2
    columns = _columns(measured)
    lines.append("  " + f"{'impl':<{width}}" + "".join(f"{c[0]:>11}" for c in columns))
    for r in measured:
      cells = "".join(f"{_cell(r, *c[1:]):>11}" for c in columns)
      flag = "  (memory: not in the cache, so the peak includes compiling)"
      flag = flag if r.get("compiled_here") else ""
      lines.append(f"  {r['impl']:<{width}}{cells}{flag}")
  if base:
    lines.append(f"  ratios against {base}, the faster naive head here")
  for r in rows:
    if "time_ms" not in r:
      status = "not run" if "skipped" in r else "failed"
      reason = r.get("skipped") or r.get("error", "?")
      lines.append(f"  {status}: {r['impl']} ({reason[:200]})")
    elif "memory_error" in r:
      lines.append(f"  no memory for {r['impl']}: {r['memory_error'][:200]}")
  return lines


def format_table(
  rows: Sequence[dict],
  *,
  not_installed: Sequence[str] = (),
  timing: dict | None = None,
  accuracy: bool = False,
) -> str:
  """The result table: a block per case, then notes saying what it shows.

  Args:
    rows: result rows (``time_ms``, ``extra_bytes``, ``baseline``, and the
      fields of ``problem``).
    not_installed: peers left out because they are not installed.
    timing: ``reps``, ``rounds``, ``max_rounds`` for the statistic's note.
    accuracy: whether the gradient errors were measured.
  """
  lines = []
  for name in dict.fromkeys(r["case"] for r in rows):
    block = [r for r in rows if r["case"] == name]
    lines += _case_block(name, block) + [""]
  notes = [BASELINE_NOTE]
  if timing:
    plural = lambda n, what: f"{n} {what}" + ("s" if n != 1 else "")
    notes.append(
      STATISTIC_NOTE.format(
        reps=plural(timing["reps"], "step"),
        rounds=plural(timing["rounds"], "round"),
        max_rounds=timing["max_rounds"],
      )
    )
  methods = {r.get("extra_method", "") for r in rows if "extra_bytes" in r}
  notes += [
    note
    for key, note in MEMORY_NOTES.items()
    if any(m.startswith(key) for m in methods)
  ]
  if any("first_call_extra_bytes" in r for r in rows):
    notes.append(FIRST_CALL_NOTE)
  if accuracy:
    notes.append(ACCURACY_NOTE)
  else:
    notes.append("Gradient errors (dh err, dw err): run with --accuracy.")
  if not_installed:
    names = ", ".join(not_installed)
    notes.append(f"Not installed, so not measured: {names}.")
  for note in notes:
    lines += textwrap.wrap(note, 88, subsequent_indent="  ")
  return "\n".join(lines)


# Per series: marker, line style, marker size. Hollow markers of different
# shapes and sizes stay visible where two series coincide.
_STYLES = [
  ("o", "-", 11),
  ("s", "--", 8),
  ("^", ":", 6),
  ("D", "-.", 5),
  ("v", "-", 5),
  ("P", "--", 5),
]


def _title(rows: Sequence[dict], device: str) -> str:
  shapes = dict.fromkeys(
    f"D={r['dim']:,}, V={r['vocab']:,}, {r['dtype']}, weight {r['weight_layout']}"
    for r in rows
    if "dim" in r
  )
  what = "; ".join(list(shapes)[:3]) + ("; ..." if len(shapes) > 3 else "")
  return f"value_and_grad of the LM-head loss: {what}\non {device}"


def _memory_unit(rows: Sequence[dict]) -> tuple[str, float]:
  largest = max((r.get("extra_bytes") or 0 for r in rows), default=0)
  return ("GiB", 2**30) if largest >= 2**30 else ("MiB", 2**20)


def plot(rows: Sequence[dict], path: str, device: str) -> str | None:
  """Writes ``figure(rows, device)`` to ``path``; returns why not, or None."""
  try:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
  except ImportError:
    return "matplotlib is not installed (pip install 'mst_jax[bench]')"
  if not any("time_ms" in r for r in rows):
    return "nothing was measured"
  fig = figure(rows, device)
  fig.savefig(path, dpi=120)
  plt.close(fig)
  return None


def figure(rows: Sequence[dict], device: str):
  """Time and extra memory of every measured row, side by side.

  Against tokens N (one line per case and implementation) where a case has
  several N, else bars per case. Each panel has its own legend; the title
  gives the shapes, dtype and device.
  """
  import matplotlib.pyplot as plt
  from matplotlib import ticker

  rows = [r for r in rows if "time_ms" in r]
  unit, scale = _memory_unit(rows)
  series = {}
  for r in rows:
    series.setdefault((r["case"].split("@")[0], r["impl"]), []).append(r)
  fig, axes = plt.subplots(1, 2, figsize=(12, 4.8))
  panels = [
    (axes[0], "time_ms", 1.0, "step time", "{:.3g} ms"),
    (axes[1], "extra_bytes", scale, "extra memory", "{:.3g} " + unit),
  ]
  if any(len(points) > 1 for points in series.values()):
    _lines(series, panels, ticker)
  else:
    _bars(series, panels)
  for ax, _, _, ylabel, text in panels:
    ax.set_ylabel(ylabel)
    ax.set_ylim(bottom=0)
    ax.yaxis.set_major_formatter(ticker.FuncFormatter(lambda v, _, t=text: t.format(v)))
    ax.grid(True, axis="y", alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
      ax.legend(fontsize=8)
    else:
      ax.text(0.5, 0.5, "not measured", ha="center", transform=ax.transAxes)
  fig.suptitle(_title(rows, device), fontsize=10)
  fig.tight_layout()
  return fig


def _label(case: str, impl: str, cases: set) -> str:
  return impl if len(cases) == 1 else f"{impl} ({case})"


def _lines(series: dict, panels: list, ticker) -> None:
  """One line per (case, impl) against N on a log2 axis ticked at each N."""
  cases = {case for case, _ in series}
  impls = list(dict.fromkeys(impl for _, impl in series))
  tokens = sorted({r["tokens"] for points in series.values() for r in points})
  for (case, impl), points in series.items():
    points.sort(key=lambda r: r["tokens"])
    marker, style, size = _STYLES[impls.index(impl) % len(_STYLES)]
    for ax, key, scale, _, _ in panels:
      if any(r.get(key) is None for r in points):
        continue
      ax.plot(
        [r["tokens"] for r in points],
        [r[key] / scale for r in points],
        marker=marker,
        linestyle=style,
        markersize=size,
        markerfacecolor="none",
        markeredgewidth=1.5,
        alpha=0.85,
        label=_label(case, impl, cases),
      )
  for ax, *_ in panels:
    ax.set_xscale("log", base=2)
    ax.xaxis.set_major_locator(ticker.FixedLocator(tokens))
    ax.xaxis.set_minor_locator(ticker.NullLocator())
    ax.xaxis.set_major_formatter(ticker.FuncFormatter(lambda v, _: f"{v:,.0f}"))
    ax.set_xlabel("tokens N")


def _bars(series: dict, panels: list) -> None:
  """Bars grouped by case, one per implementation, each labelled with its value."""
  cases = list(dict.fromkeys(case for case, _ in series))
  impls = list(dict.fromkeys(impl for _, impl in series))
  width = 0.8 / len(impls)
  hatches = ["", "//", "..", "xx", "\\\\", "oo"]
  for i, impl in enumerate(impls):
    for ax, key, scale, _, text in panels:
      found = [
        (j, series[(c, impl)][0]) for j, c in enumerate(cases) if (c, impl) in series
      ]
      found = [(j, r[key] / scale) for j, r in found if r.get(key) is not None]
      if not found:
        continue
      bars = ax.bar(
        [j + (i - (len(impls) - 1) / 2) * width for j, _ in found],
        [v for _, v in found],
        width,
        label=impl,
        hatch=hatches[i % len(hatches)],
        alpha=0.85,
      )
      ax.bar_label(bars, [text.format(v) for _, v in found], fontsize=7)
  labels = {}
  for (case, _), points in series.items():
    labels.setdefault(case, f"{case}, N={points[0]['tokens']:,}")
  for ax, *_ in panels:
    ax.set_xticks(range(len(cases)), [labels[c] for c in cases])
    ax.margins(y=0.15)
