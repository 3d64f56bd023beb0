"""A stand-in for a device side stream on CPU (``Platform.side_stream``), for the overlap tests:
forked work runs inline, and the order of forks and joins is logged."""
from __future__ import annotations

import contextlib


class RecordingSideStream:
    """Runs forked work inline; ``log`` gets "fork" and "join" (tests may append their own
    entries, e.g. the copies and kernel passes of the provider that owns the stream)."""

    def __init__(self):
        self.log, self.forked = [], False
        self.roles: list[tuple[str, str]] = []
        """("fork" | "join", role) in order."""

    @contextlib.contextmanager
    def fork(self, role: str = "misses"):
        self.log.append("fork")
        self.roles.append(("fork", role))
        self.forked = True
        try:
            yield
        finally:
            self.forked = False

    def join(self, role: str = "misses"):
        self.log.append("join")
        self.roles.append(("join", role))


def hand_out_side_streams(monkeypatch, platform_type) -> list[RecordingSideStream]:
    """Make ``platform_type.side_stream`` return a new recording stream; returns every stream it
    makes (in the order the providers asked)."""
    made: list[RecordingSideStream] = []

    def side_stream(self, device):
        made.append(RecordingSideStream())
        return made[-1]
    monkeypatch.setattr(platform_type, "side_stream", side_stream, raising=False)
    return made
