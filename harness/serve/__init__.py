"""Serving processes: the process owner, ports, vLLM command lines and environments, server sets (launched or attached),
/metrics parsing, the CPU tuning injected into vLLM."""
