"""The public functions' arguments: the options, declared once, and the
inputs, checked and flattened into rows (and per-row outputs reduced back).
"""
