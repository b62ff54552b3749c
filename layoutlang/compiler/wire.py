"""What crosses the link for one op: the wire format rule (LANGUAGE.md 4 and 4.1).

A plain destination receives its own dtype (the sender casts). A quantized
destination receives, per op:

- its own quantized format (data and scales: "quantized wire") when the op's
  destination slice covers whole scale blocks of the destination's local
  storage: every block is then quantized by exactly one sender, from the same
  bf16 values the receiver would have assembled, so the bytes equal the bf16
  path's (quantization is block-local once the per-tensor scale, if the
  format has one, is agreed: fp8_e4m3/e5m2 and nvfp4's global scale come from
  the destination tensor's amax, agreed in one small exchange per bucket);
- bf16 otherwise (a block shared by two ops, a block holding padding, or a
  strided op: the receiver assembles those in bf16 and quantizes them once).

`compile_plan(..., wire="bf16")` forces bf16 for every quantized destination
(the v1 rule). The rule is a function of the op's slice, the destination's
local shape and dtype: every rank derives the same formats.
"""

from __future__ import annotations

from math import prod

from layoutlang.ir import ELEMENT_BYTES, QUANTIZED
from layoutlang.vocabulary import DTYPE

from . import strides

WIRE_MODES = ("auto", "bf16")
SCALE_EXCHANGE_BYTES = 8  # a per-tensor scale: the sender's fp32 amax one way, the agreed fp32 scale back


def wire_dtype(dst_dtype: str) -> str:
    """The bf16-path wire dtype: the destination's dtype, unless it is quantized, then bf16."""
    return "bf16" if dst_dtype in QUANTIZED else dst_dtype


def tensor_scaled(dtype: str) -> bool:
    """Does `dtype` keep one scale per local tensor (agreed before senders quantize blocks)?"""
    return any(not g.block for g in DTYPE[dtype].scales)


def _trailing(grid, ndim: int) -> tuple[int, ...]:
    """The grid's block along the tensor's trailing dims (a 1-dim tensor uses the last only)."""
    return grid.block[len(grid.block) - min(len(grid.block), ndim):]


def covers_whole_blocks(dst_slice, local: tuple[int, ...], dtype: str) -> bool:
    """Does `dst_slice` (local storage coordinates) cover only whole scale blocks of `dtype`?

    Per block grid, along each trailing dim the grid blocks: the slice starts on a
    block boundary and stops on one or at the local tensor's end (an edge block,
    whole as far as it goes). A per-tensor scale blocks nothing.

    >>> covers_whole_blocks(((0, 2), (32, 64)), (4, 64), "mxfp8")
    True
    >>> covers_whole_blocks(((0, 2), (16, 48)), (4, 64), "mxfp8")
    False
    >>> covers_whole_blocks(((128, 300),), (300,), "fp8_b128")
    True
    >>> covers_whole_blocks(((0, 4, 2), (0, 64)), (4, 64), "mxfp8")  # strided: bf16
    False
    """
    if any(len(d) != 2 for d in dst_slice):
        return False  # a strided op (layoutlang/compiler/strides.py) travels bf16: its blocks are not one box
    ndim = len(local)
    for grid in DTYPE[dtype].scales:
        block = _trailing(grid, ndim)
        for i, b in enumerate(block):
            d = ndim - len(block) + i
            a, z = dst_slice[d][0], dst_slice[d][1]
            if a % b or (z % b and z != local[d]):
                return False
    return True


def scale_slice(dst_slice, local: tuple[int, ...], grid) -> tuple[tuple[int, int], ...]:
    """The scales a block-aligned slice covers, in the scale tensor's coordinates (() for a
    per-tensor scale).

    >>> from layoutlang.vocabulary import DTYPE

from . import strides
    >>> scale_slice(((1, 3), (32, 96)), (4, 96), DTYPE["mxfp8"].scales[0])
    ((1, 3), (1, 3))
    """
    if not grid.block:
        return ()
    ndim = len(local)
    block = _trailing(grid, ndim)
    lead = ndim - len(block)
    out = list(dst_slice[:lead])
    for i, b in enumerate(block):
        a, z = dst_slice[lead + i]
        out.append((a // b, -(-z // b)))
    return tuple(out)


def data_slice(dst_slice, dtype: str) -> tuple[tuple[int, int], ...]:
    """The stored bytes of a slice of elements: packed e2m1 holds two per byte along the last dim."""
    per = DTYPE[dtype].per_byte
    if per == 1 or not dst_slice:
        return tuple(dst_slice)
    a, z = dst_slice[-1]
    return tuple(dst_slice[:-1]) + ((a // per, -(-z // per)),)


def quantized_bytes(dst_slice, local: tuple[int, ...], dtype: str) -> int:
    """Bytes one quantized-wire op moves: its data, the scales of its blocks, and the per-tensor
    scale exchange where the format has one.

    >>> quantized_bytes(((0, 4), (0, 64)), (4, 64), "mxfp8")   # 256 e4m3 + 8 e8m0
    264
    >>> quantized_bytes(((0, 4), (0, 64)), (4, 64), "nvfp4")   # 128 B packed + 16 e4m3 + exchange
    152
    """
    n = prod(b - a for a, b in data_slice(dst_slice, dtype))
    for grid in DTYPE[dtype].scales:
        if grid.block:
            n += prod(b - a for a, b in scale_slice(dst_slice, local, grid)) * grid.bytes
        else:
            n += SCALE_EXCHANGE_BYTES
    return n


def forwards(op, src_dtype: str, src_local: tuple[int, ...]) -> bool:
    """Does this quantized-wire op carry its source's own bytes (LANGUAGE.md 4.1: a source stored
    in the same format with the same block grid is forwarded without dequantizing)?

    Yes when the source is stored in the op's wire format, the format has no per-tensor scale
    (that scale is the destination's, agreed anew), the op is no relay and not transposed, and
    both slices are plain boxes of equal extents covering whole blocks of their own tensors:
    then the source's blocks are the destination's, edge blocks included (a partial edge
    block on one side ends the slice there, so the other side's slice ends at its edge too).
    A stacked side (a slice with one more dim) goes the bf16 way.
    """
    if op.wire is None or op.wire != src_dtype or tensor_scaled(src_dtype) or op.after or op.transpose is not None:
        return False
    if len(op.src_slice) != len(op.dst_slice):
        return False
    if any(len(s) != 2 or s[1] - s[0] != d[1] - d[0] for s, d in zip(op.src_slice, op.dst_slice)):
        return False
    return covers_whole_blocks(op.src_slice, src_local, src_dtype)


def op_wire(dst_slice, local: tuple[int, ...], dst_dtype: str, mode: str = "auto") -> tuple[str | None, int]:
    """(quantized wire format or None, bytes on the wire) of an op into a destination of `dst_dtype`."""
    if dst_dtype in QUANTIZED and mode == "auto" and covers_whole_blocks(dst_slice, local, dst_dtype):
        return dst_dtype, quantized_bytes(dst_slice, local, dst_dtype)
    return None, strides.elements(dst_slice) * ELEMENT_BYTES[wire_dtype(dst_dtype)]
