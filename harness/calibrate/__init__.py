"""Logprob thresholds from measurement: the noise of a correct run against the effect of a known KV fault."""
