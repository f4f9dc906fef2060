"""GPU runs: the placement plan (pure), NVML checks, the caller's CUDA_VISIBLE_DEVICES mapped onto NVML's GPUs,
simulated GPU boxes (PD_HARNESS_SIMULATED_GPUS), applying the plan to a run, GPU detection, the plan command."""
