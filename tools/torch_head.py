"""The LM head in torch on the same GPU: what its cuBLAS GEMMs allow.

Published fused heads (Liger's, QuACK's) are torch kernels timed on their
authors' H200s. This times, in torch on this machine, bfloat16 inputs:

- each of the head's three GEMMs alone (cuBLAS), and their sum;
- torch's naive head: bfloat16 logits cast to float32, ``cross_entropy``,
  backward (what a torch user's head does);
- a chunked head in eager torch (each chunk's bfloat16 logits, float32
  softmax, bfloat16 ``dlogits`` in place, ``dhidden`` rows and ``dweight +=``
  by cuBLAS): the algorithm of the fused heads, without their fusion.

Each time is the median of ``--reps`` CUDA-event timings after a warm-up:

  python tools/torch_head.py --tokens 8192 --dim 4096 --vocab 128256 --out t.json
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch
import torch.nn.functional as F


def time_ms(fn, reps: int) -> float:
  """The median of ``reps`` timings of ``fn`` (CUDA events), after 3 warm-ups."""
  for _ in range(3):
    fn()
  times = []
  for _ in range(reps):
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(True)
    start.record()
    fn()
    end.record()
    torch.cuda.synchronize()
    times.append(start.elapsed_time(end))
  return statistics.median(times)


def naive_step(hidden, weight, labels):
  hidden = hidden.detach().requires_grad_()
  weight = weight.detach().requires_grad_()
  logits = (hidden @ weight.T).float()
  F.cross_entropy(logits, labels).backward()
  return hidden.grad, weight.grad


def chunked_step(hidden, weight, labels, chunk: int):
  """Loss, ``dhidden`` and ``dweight`` of the mean cross-entropy, chunk by chunk."""
  n = hidden.shape[0]
  dhidden = torch.empty_like(hidden)
  dweight = torch.zeros_like(weight, dtype=torch.float32)
  loss = torch.zeros((), device=hidden.device)
  for start in range(0, n, chunk):
    h, y = hidden[start : start + chunk], labels[start : start + chunk]
    logits = h @ weight.T  # bfloat16
    lse = torch.logsumexp(logits.float(), dim=-1)
    loss += (lse - logits.gather(1, y[:, None])[:, 0].float()).sum() / n
    dlogits = torch.exp(logits.float() - lse[:, None]).div_(n).to(logits.dtype)
    dlogits[torch.arange(len(y), device=y.device), y] -= 1.0 / n
    dhidden[start : start + chunk] = dlogits @ weight
    dweight += dlogits.T @ h  # a bfloat16 product added in float32
  return loss, dhidden, dweight.to(weight.dtype)


def gemm_rows(hidden, weight, reps: int) -> dict:
  """Each GEMM's ms and TFLOP/s, and the three's sum (``three_gemms``)."""
  (n, d), v = hidden.shape, weight.shape[0]
  dlogits = torch.randn(n, v, device=hidden.device, dtype=hidden.dtype) / v
  gemms = {
    "logits": lambda: hidden @ weight.T,
    "dhidden": lambda: dlogits @ weight,
    "dweight": lambda: dlogits.T @ hidden,
  }
  rows = {}
  for name, fn in gemms.items():
    ms = time_ms(fn, reps)
    rows[name] = {"ms": ms, "tflops": 2.0 * n * d * v / ms / 1e9}
  rows["three_gemms"] = {"ms": sum(rows[k]["ms"] for k in gemms)}
  return rows


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--tokens", type=int, default=8192)
  parser.add_argument("--dim", type=int, default=4096)
  parser.add_argument("--vocab", type=int, default=128256)
  parser.add_argument("--chunk", type=int, default=4096)
  parser.add_argument("--reps", type=int, default=20)
  parser.add_argument("--out", default=None)
  args = parser.parse_args(argv)
  n, d, v = args.tokens, args.dim, args.vocab
  torch.manual_seed(0)
  kw = dict(device="cuda", dtype=torch.bfloat16)
  hidden = torch.randn(n, d, **kw)
  weight = torch.randn(v, d, **kw) / d**0.5
  labels = torch.randint(0, v, (n,), device="cuda")
  rows = gemm_rows(hidden, weight, args.reps)
  flop = 2.0 * n * d * v
  steps = {
    "naive": lambda: naive_step(hidden, weight, labels),
    "chunked": lambda: chunked_step(hidden, weight, labels, args.chunk),
  }
  for name, fn in steps.items():
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    ms = time_ms(fn, args.reps)
    extra = (torch.cuda.max_memory_allocated() - before) / 2**20
    rows[name] = {"ms": ms, "tflops": 3 * flop / ms / 1e9, "peak_extra_mib": extra}
  for name, row in rows.items():
    print(f"{name:12s} " + "  ".join(f"{k} {x:.2f}" for k, x in row.items()))
  if args.out:
    info = {
      "torch": torch.__version__,
      "device": torch.cuda.get_device_name(),
      "shape": [n, d, v],
    }
    with open(args.out, "w") as f:
      json.dump({**info, "rows": rows}, f, indent=1)


if __name__ == "__main__":
  main()
