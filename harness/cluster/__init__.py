"""Runs spread over a cluster: matrix entries as Ray tasks with their GPU (or CPU) needs, each running the same
command a local matrix entry runs, merged into one matrix report and the results store (docs/multi-host.md#ray)."""
