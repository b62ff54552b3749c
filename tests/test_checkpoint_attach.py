"""checkpoint/attach.py: the places a piece is read into, against every element's own offset,
and a read out of a forked child's memory (the save's transport on one host)."""

from __future__ import annotations

import math
import os

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from layoutlang.checkpoint.attach import AttachError, available, pull, runs_of_box


@st.composite
def boxes(draw):
    shape = tuple(draw(st.lists(st.integers(1, 5), min_size=1, max_size=4)))
    box = []
    for n in shape:
        a = draw(st.integers(0, n - 1))
        box.append((a, draw(st.integers(a + 1, n))))
    return shape, tuple(box)


@settings(max_examples=200, deadline=None)
@given(boxes(), st.sampled_from([1, 2, 4]))
def test_the_places_of_a_box_are_its_elements_offsets_in_c_order(case, itemsize):
    shape, box = case
    # the reference: each element's flat index, taken in the box's C order by plain indexing
    flat = torch.arange(math.prod(shape)).reshape(shape)[tuple(slice(a, b) for a, b in box)].reshape(-1)
    want = [100 + int(i) * itemsize + k for i in flat for k in range(itemsize)]
    places = runs_of_box(box, shape, itemsize, 100)
    got = [int(at) + k for at, n in places.tolist() for k in range(n)]
    assert got == want


def test_a_strided_box_has_no_places():
    assert runs_of_box(((0, 4, 2), (0, 3)), (4, 3), 2, 0) is None


@pytest.mark.skipif(not available(), reason="no process_vm_readv")
def test_a_piece_is_read_out_of_another_process_into_its_places_and_a_dead_one_fails():
    src = torch.arange(12, dtype=torch.int16)
    go_read, go_write = os.pipe()
    child = os.fork()
    if child == 0:  # holds `src` (the same address after fork) until told to go
        os.read(go_read, 1)
        os._exit(0)
    try:
        dst = torch.zeros((3, 8), dtype=torch.int16)  # the piece: a [3, 4] column block at columns 2-5
        places = runs_of_box(((0, 3), (2, 6)), (3, 8), 2, dst.data_ptr())
        try:
            pull(child, places, src.data_ptr(), 24)
        except AttachError as e:  # a machine whose policy forbids it: the save takes the links
            pytest.skip(f"process_vm_readv refused here: {e}")
        want = torch.zeros((3, 8), dtype=torch.int16)
        want[:, 2:6] = torch.arange(12, dtype=torch.int16).reshape(3, 4)
        assert torch.equal(dst, want)
    finally:
        os.write(go_write, b"x")
        os.waitpid(child, 0)
    with pytest.raises(AttachError):  # the child is gone: its pid no longer names it
        pull(child, places, src.data_ptr(), 24)
    with pytest.raises(AttachError, match="hold 24 bytes, the piece 26"):
        pull(os.getpid(), places, src.data_ptr(), 26)
