"""Staging buffers kept from one refit step to the next.

A refit allocates the same staging buffers every step (the schedule is fixed),
and on CPU a fresh allocation of megabytes is fresh pages: the kernel faults
and zeroes every one of them, each step, on the cores the transfers need (the
allocator returns large freed blocks to the system). An arena is one block of
bytes that a bucket's buffers are carved from in order and that is reused by
the next bucket and the next step: after the first step nothing is allocated.
It holds what the largest bucket stages, which the compiler already bounds by
the budget (layoutlang/compiler/graph.py), between steps as well; `Refitter.release_staging()`
gives it back. Accelerators need none of this (their caching allocators
already reuse freed blocks), so the Refitter keeps arenas on CPU only, unless
told otherwise.
"""

from __future__ import annotations

import torch

ALIGN = 64  # bytes: every buffer starts on a cache line (and on any element size)


class StagingArena:
    """Carves a bucket's buffers from one block; `reset` when the bucket's buffers are dropped.

    A buffer that does not fit is allocated on its own, and the block grows to
    the bucket's whole need at the next reset (buffers of the current bucket
    may still point into the old block, so it never grows in place).
    """

    def __init__(self) -> None:
        self.block: torch.Tensor | None = None
        self.used = 0
        self.want = 0  # bytes the largest bucket so far carved (or tried to)

    @property
    def held(self) -> int:
        """Bytes this arena holds, in use or not."""
        return 0 if self.block is None else self.block.numel()

    def empty(self, shape, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """An uninitialized buffer of `shape` and `dtype` on `device` (carved when it fits)."""
        n = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
        start = -(-self.used // ALIGN) * ALIGN
        self.used = start + n
        self.want = max(self.want, self.used)
        block = self.block
        if block is None or block.device != device or self.used > block.numel() or n == 0:
            return torch.empty(shape, dtype=dtype, device=device)
        return block[start:start + n].view(dtype).view(shape)

    def reset(self, device: torch.device) -> None:
        """The bucket's buffers are no longer used: carve from the start again (grown if needed)."""
        if self.block is None or self.block.device != device or self.want > self.block.numel():
            self.block = None  # the old block is freed before the new one is taken
            self.block = torch.empty(self.want, dtype=torch.uint8, device=device)
            if device.type == "cpu":
                # fault its pages in now, in the step that sized it (usually the first, which meets
                # anyway), not in the next step that carves from it: that one took ~4x a steady step
                self.block.zero_()
        self.used = 0

    def release(self) -> None:
        self.block, self.used, self.want = None, 0, 0
