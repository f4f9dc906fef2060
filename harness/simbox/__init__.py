"""The simulated GPU box (PD_HARNESS_SIMULATED_GPUS, a test switch): its description and stand-in ``pynvml``, put in
the real NVML's place through GPU discovery's one seam (harness/gpu/source.py; box.py), the processes on it
(claims.py), and the stand-in servers that run there in vLLM's place (standin.py, answering with standin_model.py).
Real discovery (harness/gpu) never imports it."""
