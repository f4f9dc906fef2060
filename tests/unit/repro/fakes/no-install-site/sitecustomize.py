"""Loaded by fakes/python-no-install: every distribution reads as installed at version "0" (nothing is installed)."""

import importlib.metadata

importlib.metadata.version = lambda distribution_name: "0"
