"""Gated DeltaNet (Qwen3-Next, Qwen3.5): the layer (``layer.py``), its kernels' torch reference
(``torch_ref.py``) and the backend choice (``registry.py``)."""
