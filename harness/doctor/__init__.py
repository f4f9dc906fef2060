"""`python -m harness doctor`: is this box ready for the night? Pure checks over a small typed inventory of it
(NVML, the GPUs, the driver against each environment's torch, the models and GSM8K in the hub cache, lm-eval, disk)."""
