"""Speed benchmarks (kernels, rollout engine) and the long results tables they append to."""
