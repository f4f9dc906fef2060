"""GPU runs: the placement plan (pure), NVML checks, the caller's CUDA_VISIBLE_DEVICES mapped onto NVML's GPUs,
where discovery reads the GPUs from (the real NVML, or a source put in its place: source.py), applying the plan to a
run, GPU detection, the plan command. The simulated GPU box is harness/simbox, above this package."""
