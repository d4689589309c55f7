"""Expert offloading (docs/architecture.md §5): routed experts in (pinned) host memory, a device
cache of expert slots with a replacement policy, misses split between copies and CPU compute by the
q* rule, calibration of the bandwidths that rule needs. Knows tensors and expert ids only."""
