"""The run's own machinery, beside the performance plugins of `perf/`: process groups, pre-emption, the run
directory's lock, parent-death signals, the non-finite guard, metrics and step statistics, validation, the memory
plan and the host-sync counter."""
