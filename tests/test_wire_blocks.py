"""Quantized wire, one process: blocks quantized by their senders and unpacked by the receiver
hold exactly the bytes of quantizing the whole local tensor once (LANGUAGE.md 4.1).

The reference is `quantize` of the whole tensor (itself checked bit by bit against
tests/reference_quant.py in test_quant_reference.py); the pieces are cut by hand on block
boundaries (edge blocks partial where the format allows), as the compiler's rule
(layoutlang/compiler/wire.py) would cut them.
"""

import pytest
import torch

from layoutlang.runtime.quant import empty, quantize, tensors_of
from layoutlang.runtime.wire import landed, pack, unpack_into, wire_bytes, write_tensor_scale

# (dtype, local shape, pieces as (rows, cols) boxes covering it on whole blocks)
CASES = [
    ("mxfp8", (6, 96), [((0, 2), (0, 96)), ((2, 6), (0, 32)), ((2, 6), (32, 96))]),
    ("mxfp4", (4, 64), [((0, 4), (0, 32)), ((0, 4), (32, 64))]),
    ("nvfp4", (3, 48), [((0, 1), (0, 48)), ((1, 3), (0, 16)), ((1, 3), (16, 48))]),
    # 300 x 136: 128-blocks with partial edges (rows 256..300, cols 128..136)
    ("fp8_b128", (300, 136), [((0, 128), (0, 136)), ((128, 256), (0, 128)), ((128, 256), (128, 136)),
                              ((256, 300), (0, 136))]),
    ("fp8_e4m3", (5, 7), [((0, 2), (0, 7)), ((2, 5), (0, 3)), ((2, 5), (3, 7))]),
    ("fp8_e5m2", (5, 7), [((0, 5), (0, 4)), ((0, 5), (4, 7))]),
]


def _raw(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


@pytest.mark.parametrize("dtype, shape, pieces", CASES, ids=[c[0] for c in CASES])
def test_packed_blocks_equal_quantizing_the_whole_tensor(dtype, shape, pieces):
    torch.manual_seed(0)
    x = (torch.randn(shape) * torch.logspace(-3, 3, shape[-1])).to(torch.bfloat16)
    want = quantize(x, dtype)
    amax = x.to(torch.float32).abs().amax()  # what the receiver agrees for a per-tensor scale
    got = empty(dtype, shape)
    for t in tensors_of(got):
        t.view(torch.uint8).fill_(0xA5)  # garbage: every byte must be written
    for box in pieces:
        block = x[tuple(slice(a, b) for a, b in box)]
        buf = pack(block, dtype, amax)
        assert buf.dtype == torch.uint8 and buf.numel() == wire_bytes(dtype, box, shape)
        unpack_into(buf, got, dtype, box, shape)
        assert torch.equal(landed(got, dtype, box, shape), buf)
    write_tensor_scale(got, dtype, amax)
    for a, b in zip(tensors_of(got), tensors_of(want)):
        assert torch.equal(_raw(a), _raw(b))


def test_wire_bytes_by_hand():
    # mxfp8 [2, 64]: 128 e4m3 + 4 E8M0; mxfp4: 64 packed + 4; nvfp4: 64 packed + 8 e4m3 (the global
    # scale does not travel with the blocks); fp8_b128 [130, 10]: 1300 e4m3 + 2 fp32 block scales
    assert wire_bytes("mxfp8", ((0, 2), (0, 64)), (2, 64)) == 132
    assert wire_bytes("mxfp4", ((0, 2), (0, 64)), (2, 64)) == 68
    assert wire_bytes("nvfp4", ((0, 2), (0, 64)), (2, 64)) == 72
    assert wire_bytes("fp8_b128", ((0, 130), (0, 10)), (130, 10)) == 1300 + 2 * 4
