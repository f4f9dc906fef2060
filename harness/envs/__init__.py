"""vLLM environments: one per version under .venvs/ (installed on demand), the pinned one in .venv; the bounds on
every pip subprocess (pip_limits.py, also used by the wheelhouse)."""
