"""vLLM environments: one per version under .venvs/ (installed on demand), the pinned one in .venv, wheelhouses for offline installs."""
