"""Benchmarks of the LM-head loss: ``python -m mst_jax.bench --help``.

``cases`` names the problems and implementations, ``measure`` takes one
measurement (in a fresh process on a GPU), ``kernels`` times the per-chunk CE
kernels alone, and ``cli`` runs sweeps and writes the table, JSON and plot.
"""
