"""The kernel benchmark (benchmarks/bench_kernels.py is its command line), one module per kernel family."""
