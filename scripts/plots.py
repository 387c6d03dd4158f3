"""The README's H200 tables and plots, drawn from the data files in docs/data/.

  python scripts/plots.py             # both plots, then both tables' rows
  python scripts/plots.py --tables    # the tables' markdown rows only

- ``h200_heads.json``: one ``python -m mst_jax.bench`` invocation per table row;
  printed as the README's rows and as docs/benchmarks.md's (with each row's
  date and commit). tests/test_bench.py checks both documents hold them.
- ``h200_llama_tokens.json``: the Llama-3 head at 2048 to 131072 tokens, drawn
  with the benchmark's own plot (``mst_jax.bench.report.figure``) as
  docs/bench_h200_llama.png.
- ``h200_llama_low_memory.json``: small chunks with a bfloat16 ``dweight``,
  each setting's extra memory against its time over the naive head's of the
  same invocation, as docs/frontier_h200_llama.png.
"""

from __future__ import annotations

import argparse
import json
import math
import pathlib
from collections.abc import Sequence

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from mst_jax.bench import report  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parents[1]
DATA = ROOT / "docs" / "data"
NAIVE = ("naive", "naive_cast")
MIB, GIB = 2**20, 2**30


def load(name: str, data: pathlib.Path = DATA) -> dict:
  return json.loads((data / name).read_text())


# The tables.


def _memory(n_bytes: float) -> str:
  """``5.87 GiB``, ``11.7 GiB``, ``811 MiB``: three figures, or whole MiB."""
  if n_bytes < GIB:
    return f"{n_bytes / MIB:.0f} MiB"
  gib = n_bytes / GIB
  return f"{gib:.1f} GiB" if gib >= 10 else f"{gib:.2f} GiB"


def _two_figures(x: float) -> str:
  """``0.34``, ``0.088``, ``0.50``: two significant figures, trailing zeros kept."""
  return f"{x:.{max(0, 1 - math.floor(math.log10(x)))}f}"


def baseline(rows: Sequence[dict]) -> dict:
  """The faster naive head, as the benchmark takes its ratios."""
  return min((r for r in rows if r["impl"] in NAIVE), key=lambda r: r["time_ms"])


def cells(entry: dict) -> tuple[str, str, str, str]:
  """(naive, mst_jax, time ratio, extra-memory ratio) of one table row."""
  base = baseline(entry["rows"])
  shown = next(r for r in entry["rows"] if r["impl"] == entry["shown"])

  def cell(row: dict) -> str:
    time = f"{row['time_ms']:.2f} ms"
    return time if entry.get("time_only") else f"{time}, {_memory(row['extra_bytes'])}"

  time_x = shown["time_ms"] / base["time_ms"]
  mem_x = shown["extra_bytes"] / base["extra_bytes"]
  return cell(base), cell(shown), f"{time_x:.2f}x", f"{_two_figures(mem_x)}x"


def table_rows(heads: dict, *, readme: bool) -> list[str]:
  """The markdown rows of the README's table (``readme``) or of
  docs/benchmarks.md's, which adds each row's date and commit."""
  rows = []
  for entry in heads["measurements"]:
    if readme and "readme" not in entry:
      continue
    label = entry["readme"] if readme else entry["label"]
    measured = [] if readme else [f"{entry['date']}, {entry['commit']}"]
    rows.append("| " + " | ".join([label, *cells(entry), *measured]) + " |")
  return rows


# The plot against tokens.


def tokens_figure(sweep: dict):
  """The benchmark's plot of the sweep, with where the naive head ran out of
  memory marked on both panels."""
  shape = dict(dim=4096, vocab=128256, dtype="bfloat16", weight_layout="[V, D]")
  rows = [dict(r, **shape) for r in sweep["rows"] if "time_ms" in r]
  device = (
    f"{sweep['device'].split(',')[0]}, {sweep['jax']}, {sweep['date']}; mst_jax on"
    ' XLA\'s matmuls and the Triton kernels (impl="pallas" now)'
  )
  fig = report.figure(rows, device)
  for row in sweep["rows"]:
    if "error" not in row:
      continue
    for ax in fig.axes:
      ax.axvline(row["tokens"], color="0.6", lw=0.8, ls=":")
      ax.text(
        row["tokens"],
        0.5,
        f"{row['impl']}: out of memory\n(allocator's default 75%\nof the GPU)",
        transform=ax.get_xaxis_transform(),
        ha="right",
        va="center",
        fontsize=7,
        color="0.3",
      )
  return fig


# The low-memory plot.


def _canonical(impl: str) -> str:
  """One name per setting, whatever the order of its options."""
  name, _, options = impl.partition(":")
  return ":".join([name, ",".join(sorted(options.split(",")))]) if options else name


def frontier_points(measurements: Sequence[dict]) -> dict[str, tuple]:
  """``setting -> (time / naive_cast's of its invocation, extra MiB,
  first-call MiB or None)``; a setting in several invocations takes the last."""
  found = {}
  for measurement in measurements:
    rows = [r for r in measurement["rows"] if r.get("time_ms")]
    base = next(r for r in rows if r["impl"] == "naive_cast")
    for row in rows:
      if row.get("extra_bytes") is None:
        continue
      first = row.get("first_call_extra_bytes")
      found[_canonical(row["impl"])] = (
        row["time_ms"] / base["time_ms"],
        row["extra_bytes"] / MIB,
        None if first is None else first / MIB,
      )
  return found


def _label(setting: str) -> str:
  if setting == "mst_jax":
    return "mst_jax, default"
  name, _, options = setting.partition(":")
  options = sorted(options.split(","), key=lambda o: o.startswith("accum_dtype"))
  words = [o.replace("accum_dtype=bfloat16", "bf16 dweight") for o in options if o]
  return ", ".join(words) or name


def frontier_figure(points: dict[str, tuple], title: str):
  """Extra memory (log) against time; a hollow marker where a setting's first
  call peaked above its later ones."""
  fig, ax = plt.subplots(figsize=(10.5, 5.5))
  higher_first = False
  for index, (setting, (time, steady, first)) in enumerate(
    sorted(points.items(), key=lambda item: item[1][0])
  ):
    color = f"C{index % 10}"
    ax.scatter([time], [steady], color=color, s=40, zorder=3, label=_label(setting))
    ax.annotate(f"{steady:.0f} MiB", (time, steady), (6, 4), textcoords="offset points")
    if first is not None and first > 1.05 * steady:
      higher_first = True
      ax.scatter([time], [first], facecolors="none", edgecolors=color, s=40, zorder=3)
      ax.plot([time, time], [steady, first], color=color, lw=0.8, ls=":")
  if higher_first:
    ax.scatter([], [], facecolors="none", edgecolors="0.3", s=40, label="first call")
  ax.set_yscale("log")
  ax.set_xlabel("step time / naive_cast's in the same invocation")
  ax.set_ylabel("extra memory beyond inputs and gradients, MiB")
  ax.set_title(title, fontsize=10)
  ax.grid(True, which="both", alpha=0.3)
  ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1))
  fig.tight_layout()
  return fig


def frontier_title(low_memory: dict, points: dict[str, tuple]) -> str:
  first = [p for p in points.values() if p[2] is not None]
  same = first and all(p[2] <= 1.05 * p[1] for p in first)
  when = ", ".join(
    sorted({f"{m['date']} ({m['commit']})" for m in low_memory["measurements"]})
  )
  return (
    f"Llama-3 head, N=8192, bfloat16, {low_memory['device'].split(' (')[0]},"
    f" {low_memory['jax']}, {when}"
    + ("\nevery setting's first call peaks as its later ones" if same else "")
  )


def main(argv: Sequence[str] | None = None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--data", type=pathlib.Path, default=DATA)
  parser.add_argument("--out", type=pathlib.Path, default=ROOT / "docs")
  parser.add_argument("--tables", action="store_true", help="print the tables only")
  args = parser.parse_args(argv)
  if not args.tables:
    fig = tokens_figure(load("h200_llama_tokens.json", args.data))
    fig.savefig(args.out / "bench_h200_llama.png", dpi=120)
    low_memory = load("h200_llama_low_memory.json", args.data)
    points = frontier_points(low_memory["measurements"])
    fig = frontier_figure(points, frontier_title(low_memory, points))
    fig.savefig(args.out / "frontier_h200_llama.png", dpi=120)
    print(f"wrote {args.out}/bench_h200_llama.png and frontier_h200_llama.png")
  heads = load("h200_heads.json", args.data)
  for name, readme in [("README.md", True), ("docs/benchmarks.md", False)]:
    print(f"\n{name}:")
    print("\n".join(table_rows(heads, readme=readme)))


if __name__ == "__main__":
  main()
