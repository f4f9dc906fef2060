"""Shrink a failing run to the smallest configuration that still fails with the same class."""
