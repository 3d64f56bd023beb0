"""Paged KV-cache block accounting: a free list and per-request block tables.

Invariants (checked by ``check_invariants``): every block id in [0, num_blocks) is either
on the free list or owned by exactly one request, never both and never twice.
No prefix caching: blocks are never shared between requests.
"""
from __future__ import annotations

from collections import deque

from vllm.core.request import Request


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int):
        for name, v in (("num_blocks", num_blocks), ("block_size", block_size)):
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"{name}={v!r} is invalid: must be an integer >= 1")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free: deque[int] = deque(range(num_blocks))
        self._owner: dict[int, str] = {}  # block id -> request id

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return len(self._owner)

    @property
    def usage(self) -> float:
        """Fraction of blocks in use, in [0, 1]."""
        return len(self._owner) / self.num_blocks

    @property
    def capacity_tokens(self) -> int:
        return self.num_blocks * self.block_size

    def blocks_for(self, n_tokens: int) -> int:
        """Blocks needed to hold ``n_tokens`` tokens."""
        return -(-n_tokens // self.block_size)

    def can_allocate(self, n_tokens: int) -> bool:
        """Whether a request with no blocks yet could get blocks for ``n_tokens`` now."""
        return self.blocks_for(n_tokens) <= len(self._free)

    def allocate_for(self, request: Request, total_tokens: int) -> bool:
        """Grow ``request.block_ids`` to cover ``total_tokens`` tokens.

        All-or-nothing: returns False (and allocates nothing) when too few blocks are free.
        """
        need = self.blocks_for(total_tokens) - len(request.block_ids)
        if need <= 0:
            return True
        if need > len(self._free):
            return False
        for _ in range(need):
            block = self._free.popleft()
            self._owner[block] = request.request_id
            request.block_ids.append(block)
        return True

    def free(self, request: Request) -> None:
        """Return all of the request's blocks to the free list and clear its block table."""
        for block in request.block_ids:
            owner = self._owner.pop(block, None)
            if owner != request.request_id:
                raise RuntimeError(f"block {block} freed by request {request.request_id} but "
                                   f"owned by {owner!r}")
            self._free.append(block)
        request.block_ids = []

    def check_invariants(self) -> None:
        """Raise AssertionError if a block is lost, duplicated, or both free and owned."""
        free = list(self._free)
        assert len(set(free)) == len(free), "a block is on the free list twice"
        assert not set(free) & self._owner.keys(), "a block is both free and owned"
        assert len(free) + len(self._owner) == self.num_blocks, (
            f"free {len(free)} + used {len(self._owner)} != total {self.num_blocks}")
        assert all(0 <= b < self.num_blocks for b in free), "free block id out of range"
