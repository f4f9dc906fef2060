"""The ground floor: paths, errors, caches built once under a lock, atomic writes, signal handling. Imports nothing of
the harness."""
