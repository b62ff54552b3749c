"""LANGUAGE.md 4 and 4.1's wire rule, written out independently of layoutlang's vocabulary and
layoutlang/compiler/wire.py: what one op into a destination of a given dtype moves, in bytes.

A plain destination receives its own dtype. A quantized one receives its own format (data bits
per element, one scale per block it covers, 8 bytes of amax agreement for a per-tensor scale)
when the op's local destination slice is one box (no strided dim: every dim `[start, stop]`)
covering whole scale blocks (along each blocked trailing dim it starts on a block boundary and
stops on one or at the local tensor's end), bf16 otherwise.
"""

from math import prod

PLAIN_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}
# dtype: (bits per element, [(block along the trailing dims, bytes per scale)], per-tensor scale)
FORMATS = {
    "fp8_e4m3": (8, [], True),
    "fp8_e5m2": (8, [], True),
    "mxfp8": (8, [((32,), 1)], False),
    "fp8_b128": (8, [((128, 128), 4)], False),
    "mxfp4": (4, [((32,), 1)], False),
    "nvfp4": (4, [((16,), 1)], True),
}


def _count(d) -> int:
    """Elements of one dim of a slice: [start, stop], [start, stop, step] or [start, stop, step, block]."""
    if len(d) == 2:
        return d[1] - d[0]
    start, stop, step = d[:3]
    block = d[3] if len(d) > 3 else 1
    return len(range(start, stop, step)) * block


def slice_elements(sl) -> int:
    """Elements of a slice (LANGUAGE.md 6: a dim may be strided)."""
    return prod(_count(d) for d in sl)


def op_wire(dst_slice, dtype: str, local: tuple[int, ...], wire: str = "auto") -> tuple[bool, int]:
    """(travels quantized, bytes) of an op writing `dst_slice` of a local tensor of shape `local`."""
    n = prod(_count(d) for d in dst_slice)
    if dtype in PLAIN_BYTES:
        return False, n * PLAIN_BYTES[dtype]
    bits, grids, tensor_scale = FORMATS[dtype]
    ndim = len(local)
    whole = wire == "auto" and all(len(d) == 2 for d in dst_slice) and all(
        dst_slice[ndim - len(block) + i][0] % b == 0
        and (dst_slice[ndim - len(block) + i][1] % b == 0 or dst_slice[ndim - len(block) + i][1] == local[ndim - len(block) + i])
        for block, _ in grids for i, b in enumerate(block))
    if not whole:
        return False, n * 2
    total = n * bits // 8
    for block, scale_bytes in grids:
        blocks = prod(b - a for a, b in dst_slice[:ndim - len(block)])
        for i, b in enumerate(block):
            a, z = dst_slice[ndim - len(block) + i]
            blocks *= -(-z // b) - a // b
        total += blocks * scale_bytes
    return True, total + (8 if tensor_scale else 0)
