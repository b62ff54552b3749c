"""StagingArena alone: buffers carved in order from one block kept between steps.

Expected offsets are computed by hand from the rule: every buffer starts at
the next multiple of 64 bytes after the previous one's end.
"""

import os
import resource

import torch

from layoutlang.runtime.staging import ALIGN, StagingArena

CPU = torch.device("cpu")
# (shape, dtype, bytes): 30 B, then 40 B at 64, then 7 B at 128: a bucket needs 135 B
BUCKET = [((3, 5), torch.bfloat16, 30), ((10,), torch.float32, 40), ((7,), torch.uint8, 7)]
STARTS = [0, 64, 128]


def _take(arena, wanted):
    return [arena.empty(shape, dtype, CPU) for shape, dtype, _ in wanted]


def test_the_first_bucket_is_fresh_then_every_later_one_is_carved_from_one_block():
    arena = StagingArena()
    first = _take(arena, BUCKET)
    assert arena.held == 0  # nothing kept yet: the first buffers are allocated on their own
    arena.reset(CPU)
    assert arena.held == 128 + 7
    for _ in range(2):  # the next bucket, and the one after: the same block
        bufs = _take(arena, BUCKET)
        base = arena.block.data_ptr()
        assert [b.data_ptr() - base for b in bufs] == STARTS
        assert [(tuple(b.shape), b.dtype) for b in bufs] == [(s, d) for s, d, _ in BUCKET]
        assert all(b.data_ptr() % ALIGN == 0 for b in bufs)
        arena.reset(CPU)
    assert arena.held == 135
    assert all(b.untyped_storage().data_ptr() != arena.block.data_ptr() for b in first)


def test_carved_buffers_do_not_overlap_and_keep_their_values():
    arena = StagingArena()
    _take(arena, BUCKET)
    arena.reset(CPU)
    bufs = _take(arena, BUCKET)
    for k, b in enumerate(bufs):
        b.fill_(k + 1)
    for k, b in enumerate(bufs):
        assert bool((b == k + 1).all())


def test_a_bigger_bucket_overflows_once_then_the_block_grows():
    arena = StagingArena()
    _take(arena, BUCKET)
    arena.reset(CPU)
    bigger = BUCKET + [((100,), torch.float16, 200)]  # 200 B at 192: 392 B
    bufs = _take(arena, bigger)
    base, held = arena.block.data_ptr(), arena.held
    assert not base <= bufs[-1].data_ptr() < base + held  # did not fit: its own allocation
    arena.reset(CPU)
    assert arena.held == 192 + 200
    bufs = _take(arena, bigger)
    assert [b.data_ptr() - arena.block.data_ptr() for b in bufs] == STARTS + [192]


def test_release_gives_the_block_back():
    arena = StagingArena()
    _take(arena, BUCKET)
    arena.reset(CPU)
    arena.release()
    assert arena.held == 0 and arena.block is None


def _page_faults() -> int:
    """Minor page faults of this process so far (every thread: a copy may run on torch's)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def test_a_block_is_faulted_in_when_it_is_taken_not_when_it_is_first_used():
    """A fresh CPU block of 64 MiB is untouched memory (above malloc's largest mmap threshold,
    32 MiB): its pages would fault in, and be zeroed by the kernel, in the first step that
    carves from it, making that step several times a steady one. `reset` touches them in the
    step that sized the block, so the next step writes its buffers without faulting.

    Counted as page faults (getrusage, exact) while the next step writes the whole block, which
    is the cost this avoids, not as resident memory grown by `reset`: /proc/self/statm did not
    move at all there in one full test run (kernel 6.18), while the test passed alone. Without
    the touch in `reset`, the write below faults on every page of the block."""
    arena = StagingArena()
    size = 64 * 2**20
    arena.empty((size,), torch.uint8, CPU)  # the first bucket: fresh, and the block's size is known
    arena.reset(CPU)
    assert arena.held == size
    before = _page_faults()
    arena.empty((size,), torch.uint8, CPU).fill_(1)  # the next step carves and writes it all
    faults = _page_faults() - before
    pages = size // os.sysconf("SC_PAGE_SIZE")
    assert faults < pages // 4, f"{faults} page faults writing a {pages}-page block that reset had touched"
