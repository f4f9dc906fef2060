"""Repro bundles: a folder a maintainer runs without this project (repro.sh, a standalone model builder, ISSUE.md)."""
