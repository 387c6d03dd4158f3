"""The Mosaic GPU GEMM (Hopper): argument checks and config, the kernels, and
the epilogues they run on the accumulator.
"""
