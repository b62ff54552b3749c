"""Which transfers go through a staging buffer: the one rule the steps apply and the buckets count.

layoutlang/compiler/steps.py makes a rank's steps with it (a staged send or receive gets a buffer of its
own); layoutlang/compiler/graph.py counts the same buffers to cut buckets under the budget. Both read
this module, neither the other.
"""

from __future__ import annotations

from layoutlang.ir import QUANTIZED


def contiguous(sl: tuple[tuple[int, int], ...], shape: tuple[int, ...]) -> bool:
    """Is this slice one contiguous block of a row-major tensor of `shape`? (A strided dim never is.)"""
    k = 0
    while k < len(sl) and sl[k][1] - sl[k][0] == 1:
        k += 1  # leading dims of extent one
    # a strided dim (layoutlang/compiler/strides.py: [start, stop, step(, block)]) never is
    return (k == len(sl) or len(sl[k]) == 2) and all(sl[i] == (0, shape[i]) for i in range(k + 1, len(sl)))


def send_staged(src_slice, src_local: tuple[int, ...], src_dtype: str, wire: str, turned: bool,
                strided: bool) -> bool:
    """A bf16-path send goes through a buffer unless its source block is already one contiguous
    block of the wire dtype in the sender's storage (a quantized source: in its bf16
    dequantization, which is ours, so never strided)."""
    if src_dtype in QUANTIZED:
        return turned or wire != "bf16" or not contiguous(src_slice, src_local)
    return strided or turned or src_dtype != wire or not contiguous(src_slice, src_local)


def recv_staged(dst_slice, dst_local: tuple[int, ...], dst_dtype: str, strided: bool) -> bool:
    """A bf16-path receive lands in its destination view (a quantized destination: its bf16
    assembly, which is ours) unless that view is not one contiguous block, or a caller's
    tensor may be strided."""
    if dst_dtype not in QUANTIZED and strided:
        return True
    return not contiguous(dst_slice, dst_local)
