"""The one way a layer's backend is chosen: a registry of backends that can each say why they
cannot run a query, and a selection that explains itself.

Used by the MoE (``fused_moe/registry.py``) and attention (``attention/registry.py``) backends.
A backend has ``name`` and ``refusal(query) -> reason | None``; a query has ``describe()``.
"auto" tries ``order`` (the platform's preference), then every other registered backend in
registration order, skipping any whose ``auto`` attribute is False (forced-only: not yet run
where it matters); a forced name that cannot run the query is an error that names the reason
and the backends that would. Each distinct choice is logged once.
"""
from __future__ import annotations

import importlib.util
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar, Generic, Iterable, Protocol, TypeVar

from vllm.logger import init_logger, log_once

if TYPE_CHECKING:
    import torch

    from vllm.platforms import Platform

logger = init_logger(__name__)


class Query(Protocol):
    def describe(self) -> str: ...


class Backend(Protocol):
    name: str

    def refusal(self, q) -> str | None: ...


B = TypeVar("B", bound=Backend)


@dataclass(frozen=True)
class OpQuery:
    """What a kernel backend of one op is chosen for: the op in the model (activation) dtype
    on a platform. Subclasses name the op in ``what``."""
    platform: "Platform"
    dtype: "torch.dtype"
    what: ClassVar[str] = "an op"

    def describe(self) -> str:
        return f"{self.what} in {str(self.dtype).replace('torch.', '')} on {self.platform.name}"


def platform_package_refusal(platforms: tuple[str, ...] | None, platform_name: str,
                             modules: tuple[str, ...] = (), install: str = "") -> str | None:
    """The common refusal of a kernel backend: it runs only on ``platforms`` (None = all) and
    needs ``modules`` importable (checked without importing; ``install`` names what to pip
    install, default the first missing module)."""
    if platforms is not None and platform_name not in platforms:
        return f"it runs on {list(platforms)}, not {platform_name!r}"
    missing = [m for m in modules if importlib.util.find_spec(m) is None]
    if missing:
        return (f"the {missing[0]!r} module is not installed (pip install "
                f"{install or missing[0].replace('_', '-')})")
    return None


class BackendRegistry(Generic[B]):
    def __init__(self, kind: str, option: str):
        self.kind = kind
        """Shown in messages: "MoE", "attention"."""
        self.option = option
        """The engine argument that forces a backend: "moe_backend", "attention_backend"."""
        self._backends: dict[str, B] = {}

    def register(self, backend: B) -> B:
        self._backends[backend.name] = backend
        return backend

    def unregister(self, name: str) -> None:
        self._backends.pop(name, None)

    def names(self) -> tuple[str, ...]:
        return tuple(self._backends)

    def get(self, name: str) -> B:
        if name not in self._backends:
            raise ValueError(f"{self.option}={name!r} is invalid: must be 'auto' or one of "
                             f"{list(self._backends)}")
        return self._backends[name]

    def select(self, q: Query, requested: str, order: Iterable[str]) -> B:
        """The backend for ``q``: ``requested`` if it can run it (else ValueError with the
        reason and the backends that would), or for "auto" the first of ``order`` then the
        rest that can, among those without ``auto = False`` (else ValueError with every such
        backend's reason)."""
        if requested != "auto":
            backend = self.get(requested)
            reason = backend.refusal(q)
            if reason is not None:
                ok = [b.name for b in self._backends.values() if b.refusal(q) is None]
                raise ValueError(f"{self.option}={requested!r} cannot run {q.describe()}: "
                                 f"{reason}; backends that would: {ok} (or 'auto')")
        else:
            names = [n for n in order if n in self._backends]
            names += [n for n in self._backends if n not in names]
            names = [n for n in names if getattr(self._backends[n], "auto", True)]
            reasons = {n: self._backends[n].refusal(q) for n in names}
            name = next((n for n in names if reasons[n] is None), None)
            if name is None:
                raise ValueError(f"no {self.kind} backend can run {q.describe()}: "
                                 + "; ".join(f"{n}: {r}" for n, r in reasons.items()))
            backend = self._backends[name]
        kind = self.kind[0].upper() + self.kind[1:]
        log_once(logger, logging.INFO, f"{kind} backend {backend.name} (requested "
                 f"{requested!r}) for {q.describe()}")
        return backend
