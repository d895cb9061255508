"""Plotting scripts: logged runs and committed benchmark CSVs -> figures (PNG + PDF), no GPU needed.

    python -m figures.plot_all --runs results/runs/smoke --tables results/tables/smoke --out figures/smoke
(plot_runs: training curves, mismatch, flip rates, accuracy; plot_speedups: kernel and rollout speedups;
plot_kernels.py, by the kernel work, plots the kernel CSV in detail).
"""
