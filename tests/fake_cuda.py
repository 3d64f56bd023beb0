"""A recording stand-in for the slice of ``torch.cuda`` that streams, events and graph capture
use, for CPU tests of code that must name its device (``CudaGraphCapturer``,
``CudaSideStream``). It keeps a current device and a current stream per device as CUDA does,
and logs every call with where it ran: (current device index, current stream name)."""
from __future__ import annotations

import contextlib
import itertools

import torch


class FakeStream:
    def __init__(self, cuda: "FakeCuda", index: int, name: str, priority: int = 0):
        self.cuda, self.index, self.name, self.priority = cuda, index, name, priority
        self.device = torch.device("cuda", index)

    def wait_stream(self, other: "FakeStream") -> None:
        self.cuda.log.append(("wait_stream", self.name, other.name))

    def wait_event(self, event: "FakeEvent") -> None:
        self.cuda.log.append(("wait_event", self.name, event.name))

    def __repr__(self) -> str:
        return self.name


class FakeEvent:
    def __init__(self, cuda: "FakeCuda", name: str):
        self.cuda, self.name = cuda, name

    def record(self, stream: FakeStream | None = None) -> None:
        stream = stream or self.cuda.current_stream()
        self.cuda.log.append(("record", self.name, stream.name))


class FakeGraph:
    def __init__(self, cuda: "FakeCuda"):
        self.cuda = cuda

    def capture_begin(self, pool=None) -> None:
        self.cuda.log.append(("capture_begin", pool, self.cuda.where()))

    def capture_end(self) -> None:
        self.cuda.log.append(("capture_end", self.cuda.where()))

    def replay(self) -> None:
        self.cuda.log.append(("replay", self.cuda.where()))


class FakeCuda:
    """Streams are named "default:i" (each device's current stream to begin with) and
    "s<n>:i<priority>" as made; events "e<n>"; pools ("pool", n)."""

    def __init__(self, current_device: int = 0):
        self.log: list = []
        self.index = current_device
        self.current: dict[int, FakeStream] = {}
        self._n = itertools.count()

    def _index(self, device) -> int:
        if isinstance(device, int):
            return device
        index = None if device is None else torch.device(device).index
        return self.index if index is None else index

    def where(self) -> tuple[int, str]:
        return self.index, self.current_stream().name

    def current_stream(self, device=None) -> FakeStream:
        i = self._index(device)
        return self.current.setdefault(i, FakeStream(self, i, f"default:{i}"))

    def Stream(self, device=None, priority: int = 0) -> FakeStream:   # noqa: N802 - torch's
        i = self._index(device)
        s = FakeStream(self, i, f"s{next(self._n)}:{i}", priority)
        self.log.append(("Stream", s.name, priority))
        return s

    def Event(self) -> FakeEvent:                                      # noqa: N802 - torch's
        return FakeEvent(self, f"e{next(self._n)}")

    def CUDAGraph(self) -> FakeGraph:                                  # noqa: N802 - torch's
        return FakeGraph(self)

    def graph_pool_handle(self):
        return ("pool", next(self._n))

    def synchronize(self, device=None) -> None:
        self.log.append(("synchronize", self._index(device)))

    @contextlib.contextmanager
    def device(self, device):
        prev, self.index = self.index, self._index(device)
        try:
            yield
        finally:
            self.index = prev

    @contextlib.contextmanager
    def stream(self, s: FakeStream):
        """As ``torch.cuda.stream``: the stream's device becomes current too."""
        with self.device(s.index):
            prev, self.current[s.index] = self.current_stream(), s
            try:
                yield
            finally:
                self.current[s.index] = prev

    def install(self, monkeypatch) -> None:
        """Put this fake's calls in ``torch.cuda`` for the test (code that calls torch.cuda.*)."""
        for name in ("Stream", "Event", "current_stream", "stream", "device", "synchronize"):
            monkeypatch.setattr(torch.cuda, name, getattr(self, name))
