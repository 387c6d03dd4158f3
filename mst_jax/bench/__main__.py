from mst_jax.bench.cli import main

main()
