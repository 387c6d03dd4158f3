"""Which ops touch weight-sized buffers in the compiled step (GPU diagnostics).

python tools/hlo_report.py [mst_jax kwargs as key=value ...]
Prints, for the Llama-3 head value-and-grad step, every optimized-HLO
instruction whose result has the weight's V x D shape, so copies of the weight
or of the dweight accumulator, and whether GEMMs accumulate in place, show.
"""

import re
import sys

import jax

from mst_jax.bench.cases import CASES, make_inputs, make_loss

spec = "mst_jax:" + ",".join(sys.argv[1:])
case = CASES["llama"]
step = jax.jit(jax.value_and_grad(make_loss(spec, case), argnums=(0, 1)))
text = step.lower(*make_inputs(case)).compile().as_text()
big = re.compile(r"\[128256,4096\]|\[4096,128256\]")
print(f"== {spec}: {len(text.splitlines())} HLO lines")
for line in text.splitlines():
  if big.search(line.split("=", 1)[0] + "=" + line.split("=", 1)[-1][:200]):
    line = line.strip()
    print("  ", line[:260])
