"""Matrices of P/D runs: config files, the plan, running it, the matrix command."""
