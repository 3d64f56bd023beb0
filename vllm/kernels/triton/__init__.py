"""Triton kernels (CUDA). Import only where a CUDA platform asks for them: ``triton`` is an
optional dependency of the CPU install (``pip install -e ".[cuda]"``)."""
