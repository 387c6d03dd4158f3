"""The Pallas Triton per-chunk kernels: the cross-entropy, the distillation
loss, and the blocks, loads and ``pallas_call`` they share.
"""
