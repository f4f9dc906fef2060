"""GPU runs: the placement plan (pure), NVML checks, applying the plan to a run, GPU detection, the plan command."""
