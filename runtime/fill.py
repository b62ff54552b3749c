"""Deterministic tensors from logical coordinates: fill a source, check a destination.

Every logical element of a key gets a value that depends only on (key, its
logical flat index), small integers that bf16, fp16 and fp32 hold exactly, so
a destination can be checked element by element on any rank without seeing
the source. Padding is NaN in sources (it must never travel) and zero in
destinations.
"""

from __future__ import annotations

import zlib

import torch

from layoutlang.ir import QUANTIZED, TensorIR
from layoutlang.modes import Run

from .quant import PLAIN_DTYPES, dequantize, quantize


def logical_index(t: TensorIR, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(flat logical index of every local element, mask of data elements)."""
    shape = t.local_shape
    flat = torch.zeros(shape, dtype=torch.int64)
    mask = torch.ones(shape, dtype=torch.bool)
    stride = 1
    for d in reversed(range(len(shape))):
        idx = torch.full((shape[d],), -1, dtype=torch.int64)
        for r in t.runs(rank)[d]:
            if isinstance(r, Run):
                idx[r.local_start:r.local_start + r.length] = torch.arange(r.logical_start, r.logical_start + r.length)
        view = [1] * len(shape)
        view[d] = shape[d]
        idx = idx.reshape(view)
        flat = flat + idx.clamp_min(0) * stride
        mask = mask & (idx >= 0)
        stride *= t.logical_shape[d]
    return flat, mask


def values(key: str, flat: torch.Tensor) -> torch.Tensor:
    """The value of each logical element of `key`: integers in [-125, 125]."""
    seed = zlib.crc32(key.encode("utf-8")) % 251
    return (((flat * 31 + seed) % 251) - 125).to(torch.float32)


def source_tensor(t: TensorIR, rank: int, device="cpu"):
    flat, mask = logical_index(t, rank)
    v = torch.where(mask, values(t.key, flat), torch.full_like(flat, 0, dtype=torch.float32) + float("nan"))
    if t.dtype in QUANTIZED:
        return quantize(torch.nan_to_num(v, nan=0.0).to(torch.bfloat16).to(device), t.dtype)
    return v.to(PLAIN_DTYPES[t.dtype]).to(device)


def expected_destination(t: TensorIR, rank: int, plan=None) -> torch.Tensor:
    """bf16/fp16/fp32 values the destination must hold (padding zero), before quantization.

    A quantized source cannot carry the exact values: each element is what the
    sending shard holds after its own quantization (rebuilt from the plan's op
    that delivered it; the op's slices were proven against logical
    coordinates, the values come from the source's logical fill).
    """
    wire = torch.bfloat16 if t.dtype in QUANTIZED else PLAIN_DTYPES[t.dtype]
    flat, mask = logical_index(t, rank)
    v = torch.where(mask, values(t.key, flat), torch.zeros_like(flat, dtype=torch.float32)).to(wire)
    if plan is None:
        return v
    entry = next(e for e in plan.tensors if e.key == t.key)
    if entry.src_dtype not in QUANTIZED:
        return v
    sources = {s.name: s for s in plan.src.tensors if s.key == t.key}
    for op in plan.ops_for_rank(rank):
        if op.dst_rank == rank and op.dst_name == t.name:
            src = sources[op.src_name]
            sent = dequantize(source_tensor(src, op.src_rank), src.dtype)
            v[tuple(slice(a, b) for a, b in op.dst_slice)] = sent[tuple(slice(a, b) for a, b in op.src_slice)].to(wire)
    return v


def empty_destination(t: TensorIR, device="cpu"):
    """Garbage-filled destination storage of the right shape and dtype (NaN where it can)."""
    if t.dtype in QUANTIZED:
        return quantize(torch.full(t.local_shape, 77.0, dtype=torch.bfloat16, device=device), t.dtype)
    return torch.full(t.local_shape, float("nan"), dtype=PLAIN_DTYPES[t.dtype], device=device)


def check_destination(t: TensorIR, rank: int, value, plan=None) -> str | None:
    """None if `value` holds exactly what the plan promises; else what is wrong."""
    want = expected_destination(t, rank, plan)
    if t.dtype in QUANTIZED:
        ref = quantize(want, t.dtype)
        got_data = value.data.to(torch.float32)
        if not torch.equal(got_data, ref.data.to(torch.float32)):
            bad = (got_data != ref.data.to(torch.float32)).nonzero()[0].tolist()
            return f"`{t.name}` on rank {rank}: quantized data differs at {bad}"
        scales = (value.scales, ref.scales) if t.dtype == "mxfp8" else (value.scale, ref.scale)
        if not torch.equal(scales[0].view(torch.uint8) if scales[0].dtype != torch.float32 else scales[0],
                           scales[1].view(torch.uint8) if scales[1].dtype != torch.float32 else scales[1]):
            return f"`{t.name}` on rank {rank}: quantization scales differ"
        return None
    got = value.cpu()
    if torch.isnan(got).any() or not torch.equal(got, want):
        diff = (torch.isnan(got) | (got != want)).nonzero()[0].tolist()
        return (f"`{t.name}` on rank {rank}: element {diff} is {got[tuple(diff)].item()}, "
                f"expected {want[tuple(diff)].item()}")
    return None
