"""The low-memory frontier of the Llama-3 head: extra memory against time.

Reads benchmark results (``python -m mst_jax.bench`` JSON, or several runs
keyed by name as in docs/runs/; one file or more) and plots, for one case,
each setting's extra memory (steady, and at the first call where measured)
against its time relative to the naive bfloat16 head (``naive_cast``) of the
same run. A setting measured in several runs is plotted from the last one
given (runs in the order of ``--runs``).

  python scripts/frontier_plot.py docs/runs/2026-12-02_session19_runs96-101.json \\
      --runs run97_low_memory_9c3c389 run101_low_memory_9c3c389 \\
      --out docs/frontier_h200_llama.png
"""

from __future__ import annotations

import argparse
import json
import pathlib

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

BASELINE = "naive_cast"
MIB = 2**20
# The same setting under another name: on a GPU the default is impl="pallas".
ALIASES = {"mst_jax:impl=pallas": "mst_jax"}


def _runs(paths: list[pathlib.Path], names: list[str] | None) -> dict:
  runs = {}
  for path in paths:
    data = json.loads(path.read_text())
    runs.update({path.stem: data} if "rows" in data else data)
  return {name: runs[name] for name in names} if names else runs


def _canonical(impl: str) -> str:
  """One name per setting: aliases resolved, options sorted."""
  impl = ALIASES.get(impl, impl)
  name, _, options = impl.partition(":")
  return ":".join([name, ",".join(sorted(options.split(",")))]) if options else name


def points(runs: dict, case: str) -> dict[str, tuple]:
  """``impl -> (run, time ratio, steady MiB, first-call MiB or None)``."""
  found: dict = {}
  for name, run in runs.items():
    rows = [r for r in run["rows"] if r.get("case") == case and r.get("time_ms")]
    base = next((r for r in rows if r["impl"] == BASELINE), None)
    if base is None:
      continue
    for row in rows:
      if row.get("extra_bytes") is None:
        continue
      first = row.get("first_call_extra_bytes")
      found[_canonical(row["impl"])] = (
        name,
        row["time_ms"] / base["time_ms"],
        row["extra_bytes"] / MIB,
        None if first is None else first / MIB,
      )
  return found


def _label(impl: str) -> str:
  name, _, options = impl.partition(":")
  if impl == "mst_jax":
    return "mst_jax default"
  return options.replace("accum_dtype=bfloat16", "bf16 dweight") or name


def plot(found: dict, title: str, out: pathlib.Path) -> None:
  fig, ax = plt.subplots(figsize=(10.5, 5.5))
  ax.fill_between([0.9, 1.25], 20, 64, color="tab:green", alpha=0.12, lw=0)
  ax.text(0.92, 70, "target: <= 64 MiB at <= 1.25x", color="tab:green", fontsize=8)
  for index, (impl, (_, time, steady, first)) in enumerate(sorted(found.items())):
    color = f"C{index % 10}"
    ax.scatter([time], [steady], color=color, s=40, zorder=3, label=_label(impl))
    if first is not None and first > 1.05 * steady:
      ax.scatter([time], [first], facecolors="none", edgecolors=color, s=40, zorder=3)
      ax.plot([time, time], [steady, first], color=color, lw=0.8, ls=":")
  ax.set_yscale("log")
  ax.set_xlabel(f"step time / {BASELINE}'s in the same run")
  ax.set_ylabel("extra memory, MiB (hollow: the first call's peak)")
  ax.set_title(title, fontsize=10)
  ax.grid(True, which="both", alpha=0.3)
  ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1))
  fig.tight_layout()
  fig.savefig(out, dpi=120)
  print(f"wrote {out}")


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("results", type=pathlib.Path, nargs="+")
  parser.add_argument("--runs", nargs="+", help="run names in the files (default: all)")
  parser.add_argument("--case", default="llama")
  parser.add_argument("--title", default="Llama-3 head, N=8192, bf16, NVIDIA H200")
  parser.add_argument("--out", type=pathlib.Path, default=pathlib.Path("frontier.png"))
  args = parser.parse_args()
  found = points(_runs(args.results, args.runs), args.case)
  for impl, (run, time, steady, first) in sorted(found.items()):
    first = "-" if first is None else f"{first:.0f}"
    print(f"{impl}: run {run}, {time:.3f}x, {steady:.0f} MiB (first call {first})")
  plot(found, args.title, args.out)


if __name__ == "__main__":
  main()
