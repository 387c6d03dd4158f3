"""The Mosaic GPU per-chunk kernels (Hopper): the cross-entropy, the
distillation loss, the tile statistics they share, and their tiles, grid and
launch.
"""
