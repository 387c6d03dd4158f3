"""Per-row math, written once: the cross-entropy's and the distillation's
formulas on blocks of any shape, the running sums merged one vocabulary block at
a time, and the whole-logits references written from the definitions.
"""
