"""Compiled CUDA ops: ``csrc/`` built into ``vllm._C`` (setup.py, VLLM_TARGET_DEVICE=cuda)."""
