"""One P/D run: its config, preflight, the phases (baseline, P/D, evaluation), failure mapping, report and timing."""
