"""Accuracy through lm-eval: settings, running lm-eval and reading its output, the accuracy checks."""
