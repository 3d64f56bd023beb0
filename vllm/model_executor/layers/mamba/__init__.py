"""Mamba-2 (state-space) layers: the mixer (``mamba_mixer2.py``), its torch kernels
(``ssd_torch.py``) and the backend registry that chooses the kernels (``registry.py``)."""
