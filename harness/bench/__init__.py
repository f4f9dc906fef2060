"""Benchmarks that print figures (proxy overhead, readiness/teardown, parallel start-up, a run's time breakdown)."""
