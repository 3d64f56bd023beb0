"""Kernels below the layers: ``cpu/`` holds C kernels built on first use for the CPU backend."""
