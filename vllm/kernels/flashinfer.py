"""FlashInfer (package flashinfer-python, the optional ``cuda`` extra) for the backends that call
it (``flashinfer_cutlass`` MoE, ``flashinfer_paged`` attention): whether it is installed, checked
without importing it, and its import, which runs only when such a backend is made on CUDA."""
from __future__ import annotations

import importlib
import importlib.util
from types import ModuleType

INSTALL_HINT = "pip install flashinfer-python, or the 'cuda' extra: pip install -e '.[cuda]'"


def flashinfer_refusal() -> str | None:
    """Why a FlashInfer backend cannot be chosen for want of the package, or None."""
    if importlib.util.find_spec("flashinfer") is None:
        return f"the flashinfer-python package is not installed ({INSTALL_HINT})"
    return None


def import_flashinfer(module: str, option: str) -> ModuleType:
    """``module`` (``flashinfer`` or a submodule), or ImportError naming the package, the
    extra and the ``option`` (e.g. "moe_backend='flashinfer_cutlass'") that needs it."""
    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise ImportError(f"{option} needs the flashinfer-python package, which does not "
                          f"import ({e}): {INSTALL_HINT}") from e
