"""Benchmarks of the LM-head loss: ``python -m mst_jax.bench --help``.

``cases`` names the problems and implementations, ``measure`` takes the
measurements (in fresh processes on a GPU), ``kernels`` times the per-chunk CE
kernels and head GEMMs alone, ``options`` is the command line, ``report`` the
table and plot, and ``cli`` runs the sweeps.
"""
