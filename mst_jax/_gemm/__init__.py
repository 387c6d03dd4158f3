"""The LM head's three products (logits, ``dhidden``, ``dweight``) for either
weight layout: XLA's ``dot_general`` or the Mosaic GPU GEMM.
"""
