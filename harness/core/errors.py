"""Errors every layer may raise."""

from __future__ import annotations


class ConfigError(ValueError):
    """Bad input (a flag, an env value, a config file): one line naming what is wrong; the CLI exits 2."""
