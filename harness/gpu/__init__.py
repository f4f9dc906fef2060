"""GPU runs: the placement plan (pure), NVML checks, the caller's CUDA_VISIBLE_DEVICES mapped onto NVML's GPUs,
simulated GPU boxes (PD_HARNESS_SIMULATED_GPUS) with the stand-in servers that run on them (claims.py, standin.py),
applying the plan to a run, GPU detection, the plan command."""
