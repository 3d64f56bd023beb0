"""``RehearsalPlatform``: the CUDA platform's kernel and backend choices for CPU tensors (Triton
interpreted), so CPU tests run the CUDA path (tests/worker/test_cuda_path_on_cpu.py)."""
from __future__ import annotations

from vllm.platforms.cuda import CudaPlatform


class RehearsalPlatform(CudaPlatform):
    """CUDA's kernel and backend choices for CPU tensors (Triton interpreted); no pinned memory,
    no device memory query."""
    name = "cuda"

    def is_available(self) -> bool:
        return True

    def device_name(self, device=None) -> str:
        return "CUDA rehearsal on CPU (Triton interpreter)"

    def get_device_capability(self, device=None):
        return None

    def is_pin_memory_available(self) -> bool:
        return False

    def memory_info(self, device):
        return None

    def side_stream(self, device):
        # Forked work runs inline (CPU tensors run in issue order), as a CUDA stream's would
        # after its fork; the residency step's account and overlap's copies take this path.
        from side_streams import RecordingSideStream
        return RecordingSideStream()
