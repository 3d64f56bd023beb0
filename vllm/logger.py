"""Package logger: one format, level from VLLM_LOGGING_LEVEL."""
from __future__ import annotations

import logging
import os

_ROOT = "vllm"
_configured = False
_once: set[str] = set()


def init_logger(name: str) -> logging.Logger:
    global _configured
    if not _configured:
        root = logging.getLogger(_ROOT)
        if not root.handlers:
            handler = logging.StreamHandler()
            handler.setFormatter(logging.Formatter("%(levelname)s %(asctime)s [%(name)s] %(message)s",
                                                   "%m-%d %H:%M:%S"))
            root.addHandler(handler)
        root.setLevel(os.environ.get("VLLM_LOGGING_LEVEL", "INFO").upper())
        root.propagate = False
        _configured = True
    return logging.getLogger(name if name.startswith(_ROOT) else f"{_ROOT}.{name}")


def log_once(logger: logging.Logger, level: int, msg: str) -> None:
    """Log ``msg`` the first time it is seen in this process."""
    if msg not in _once:
        _once.add(msg)
        logger.log(level, msg)
