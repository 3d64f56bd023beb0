"""C kernels for the CPU path, compiled on first use (see ``build.py``) and called through ctypes."""
