"""Evaluation tasks the project generates itself (no hub): the offline GSM8K-format task."""
