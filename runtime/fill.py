"""Deterministic tensors from logical coordinates: fill a source, check a destination.

Every logical element of a key gets a value that depends only on (key, its
logical flat index), so a destination can be checked element by element on
any rank without seeing the source or the plan. Padding is NaN in sources (it
must never travel) and zero in destinations.

What the values detect (see `values`): each is one of 1024 numbers (2 signs x
128 eight-bit significands x 4 binades, |v| in [16, 256)), chosen by a
bijective 32-bit mix of the flat index and a per-key seed, so neighbours are
independent and nothing repeats with a period. A block of n elements that
lands at the wrong logical place (shifted by any offset: one row, 251 rows, a
whole shard; two blocks swapped; a block of another key; a transposed block)
passes only if all n values happen to coincide: 1024^-n (one wrong element
escapes with probability 1/1024, two with 1e-6). An element never written
keeps NaN (plain destinations) and padding must be exactly zero: neither is
ever a value. The function is fixed, so a given error is caught (or not)
every run: the probability is over errors, not over runs.

Every value is exact in bf16 (8 significant bits), fp16 and fp32, so a plain
source and a plain destination of any of those dtypes hold it exactly. The
magnitudes keep fp8 meaningful: per-tensor e4m3 scales them into [28, 448],
e5m2 into [3584, 57344] (normal numbers), mxfp8 blocks into [32, 512) (the
top binade exercising saturation), so a misplaced element still changes the
quantized bytes with probability about 63/64.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass

import torch

from layoutlang.ir import QUANTIZED, TensorIR
from layoutlang.modes import Run

from .quant import PLAIN_DTYPES, dequantize, quantize

MASK32 = 0xFFFFFFFF


def _coords(t: TensorIR, rank: int) -> list[torch.Tensor]:
    """Per dim, the logical coordinate of each local index (-1 where it is padding)."""
    out = []
    for n, dim_runs in zip(t.local_shape, t.runs(rank)):
        idx = torch.full((n,), -1, dtype=torch.int64)
        for r in dim_runs:
            if isinstance(r, Run):
                idx[r.local_start:r.local_start + r.length] = torch.arange(r.logical_start, r.logical_start + r.length)
        out.append(idx)
    return out


def _view(x: torch.Tensor, d: int, dims: int) -> torch.Tensor:
    shape = [1] * dims
    shape[d] = x.numel()
    return x.reshape(shape)


def logical_index(t: TensorIR, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(flat logical index of every local element, mask of data elements)."""
    shape = t.local_shape
    flat = torch.zeros(shape, dtype=torch.int64)
    mask = torch.ones(shape, dtype=torch.bool)
    stride = 1
    for d in reversed(range(len(shape))):
        idx = _view(_coords(t, rank)[d], d, len(shape))
        flat = flat + idx.clamp_min(0) * stride
        mask = mask & (idx >= 0)
        stride *= t.logical_shape[d]
    return flat, mask


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A bijection of [0, 2^32) with full avalanche (int64 arithmetic, no overflow)."""
    x = (((x >> 16) ^ x) * 0x45D9F3B) & MASK32
    x = (((x >> 16) ^ x) * 0x45D9F3B) & MASK32
    return (x >> 16) ^ x


def values(key: str, flat: torch.Tensor) -> torch.Tensor:
    """The value of each logical element of `key` (float32): +-m * 2^(b-3), m in [128, 256), b in 0..3.

    >>> values("w", torch.arange(6)).tolist()
    [-16.875, -22.5, 156.0, 23.625, -24.0, 27.875]
    """
    seed = zlib.crc32(key.encode("utf-8"))
    h = _mix32(((flat & MASK32) ^ seed) ^ _mix32((flat >> 32) & MASK32))
    sign = 1.0 - 2.0 * (h & 1).to(torch.float32)
    significand = (128 + ((h >> 1) & 127)).to(torch.float32)
    binade = ((h >> 8) & 3).to(torch.float32)
    return sign * significand * torch.pow(2.0, binade - 3.0)


def key_values(t: TensorIR, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(value of every local element, mask of data elements), by (key, index in the key).

    A v2 stored tensor holding several keys (LANGUAGE.md 8.1, `t.regions`): each
    element takes the value of its key at its coordinates in that key (the stored
    coordinates minus the key box's corner); an element in no box is padding.
    """
    if t.regions is None:
        flat, mask = logical_index(t, rank)
        return torch.where(mask, values(t.key, flat), 0.0), mask
    coords = _coords(t, rank)
    dims = len(coords)
    out = torch.zeros(t.local_shape, dtype=torch.float32)
    mask = torch.zeros(t.local_shape, dtype=torch.bool)
    for r in t.regions:
        inside = torch.ones(t.local_shape, dtype=torch.bool)
        flat = torch.zeros(t.local_shape, dtype=torch.int64)
        key_dims = [d for d in range(dims) if d not in r.stacked]
        order = key_dims[::-1] if r.transposed else key_dims  # the key's dims, in the key's order
        stride = 1
        for d in reversed(order):
            lo, hi = r.box[d]
            flat = flat + (_view(coords[d], d, dims) - lo).clamp_min(0) * stride
            stride *= hi - lo
        for d in range(dims):
            lo, hi = r.box[d]
            c = _view(coords[d], d, dims)
            inside = inside & (c >= lo) & (c < hi)
        out = torch.where(inside, values(r.key, flat), out)
        mask = mask | inside
    return out, mask


def _keys(t: TensorIR) -> tuple[str, ...]:
    return (t.key,) if t.regions is None else tuple(r.key for r in t.regions)


def source_tensor(t: TensorIR, rank: int, device="cpu"):
    exact, mask = key_values(t, rank)
    v = torch.where(mask, exact, float("nan"))
    if t.dtype in QUANTIZED:
        return quantize(torch.nan_to_num(v, nan=0.0).to(torch.bfloat16).to(device), t.dtype)
    return v.to(PLAIN_DTYPES[t.dtype]).to(device)


@dataclass(frozen=True)
class Expected:
    """What a destination local tensor must hold, before its own quantization.

    `values`: in the wire dtype (bf16 for a quantized destination), padding zero;
    `data`: the mask of data (non-padding) elements;
    `choices`: empty when every element has one possible value; otherwise one
    tensor per distinct source shard, the value that shard would send (NaN
    where it holds nothing): where quantized source shards overlap and quantize
    differently, any holder's value is right, whichever sender the plan picked.
    """

    values: torch.Tensor
    data: torch.Tensor
    choices: tuple[torch.Tensor, ...] = ()


def _locate(s: TensorIR, rank: int, t: TensorIR, dst_coords: list[torch.Tensor]):
    """(held, index): which of `t`'s local elements source shard (s, rank) holds, and where.

    From the layouts alone: the shard's runs map its local storage to logical
    coordinates; invert them per dim and look up the destination's coordinates.
    """
    dims = len(dst_coords)
    held = torch.ones(t.local_shape, dtype=torch.bool)
    index = []
    for d, (sc, dc) in enumerate(zip(_coords(s, rank), dst_coords)):
        inverse = torch.full((s.logical_shape[d],), -1, dtype=torch.int64)
        data = sc >= 0
        inverse[sc[data]] = torch.arange(sc.numel())[data]
        local = torch.where(dc >= 0, inverse[dc.clamp_min(0)], -1)
        held = held & _view(local >= 0, d, dims)
        index.append(_view(local.clamp_min(0), d, dims))
    return held, tuple(index)


def expected_destination(t: TensorIR, rank: int, plan=None) -> Expected:
    """What `t` on `rank` must hold: the logical fill, or, from a quantized source, what the
    source shard holding each element has after its own quantization.

    Computed from the source LAYOUT (`plan.src`, the front end's IR: every
    source instance of the key and every rank holding it), never from the
    plan's ops: the answer must not depend on the plan under test.
    """
    wire = torch.bfloat16 if t.dtype in QUANTIZED else PLAIN_DTYPES[t.dtype]
    exact, mask = key_values(t, rank)
    keys = set(_keys(t))
    sources = [s for s in plan.src.tensors if keys & set(_keys(s))] if plan is not None else []
    if not any(s.dtype in QUANTIZED for s in sources):
        return Expected(exact.to(wire), mask)
    if t.regions is not None or any(s.regions is not None for s in sources):
        raise NotImplementedError(f"`{t.name}`: expected values from quantized sources of keys inside "
                                  "stored tensors are not computed yet")
    coords = _coords(t, rank)
    shards, seen = [], set()
    for s in sources:
        for q in s.ranks():
            runs = s.runs(q)
            if (id(s), runs) in seen:  # a replica with the same runs holds the same bytes
                continue
            seen.add((id(s), runs))
            held, index = _locate(s, q, t, coords)
            if s.dtype in QUANTIZED:
                sent = dequantize(source_tensor(s, q), s.dtype).to(torch.float32)
                sent = sent[index] if index else sent
            else:
                sent = exact  # a plain shard sends the exact values
            shards.append((held, sent))
    want = torch.full(t.local_shape, float("nan"))
    for held, sent in shards:
        want = torch.where(held & torch.isnan(want), sent, want)
    missing = mask & torch.isnan(want)
    if missing.any():
        raise ValueError(f"`{t.name}` on rank {rank}: no source shard holds local element "
                         f"{missing.nonzero()[0].tolist()}")
    want = torch.where(mask, want, 0.0)
    ambiguous = any(bool((held & (sent != want)).any()) for held, sent in shards)
    choices = tuple(torch.where(held, sent, float("nan")).to(wire) for held, sent in shards) if ambiguous else ()
    return Expected(want.to(wire), mask, choices)


def empty_destination(t: TensorIR, device="cpu"):
    """Garbage-filled destination storage of the right shape and dtype (NaN where it can;
    quantized: 3.0, never a fill value)."""
    if t.dtype in QUANTIZED:
        return quantize(torch.full(t.local_shape, 3.0, dtype=torch.bfloat16, device=device), t.dtype)
    return torch.full(t.local_shape, float("nan"), dtype=PLAIN_DTYPES[t.dtype], device=device)


def _nearest(choices: tuple[torch.Tensor, ...], target: torch.Tensor) -> torch.Tensor:
    """Per element, the choice nearest `target` (what a quantized destination decodes to)."""
    stack = torch.stack([c.to(torch.float32) for c in choices])
    distance = torch.nan_to_num((stack - target.to(torch.float32)).abs(), nan=float("inf"))
    return stack.gather(0, distance.argmin(0, keepdim=True))[0]


def _as_float(x: torch.Tensor) -> torch.Tensor:
    """Compare scales by value (fp32) or by E8M0 code (uint8 / float8_e8m0fnu)."""
    x = x.cpu()
    return x.to(torch.float32) if x.dtype == torch.float32 else x.contiguous().view(torch.uint8).to(torch.float32)


def check_destination(t: TensorIR, rank: int, value, plan=None) -> str | None:
    """None if `value` holds what the layouts promise; else what is wrong.

    `plan` is used only for its source layout (`plan.src`), never for its ops;
    without it the source is taken to be plain.
    """
    want = expected_destination(t, rank, plan)
    shape = tuple((value.data if t.dtype in QUANTIZED else value).shape)
    if shape != tuple(t.local_shape):
        return f"`{t.name}` on rank {rank}: local shape {shape}, expected {tuple(t.local_shape)}"
    if t.dtype in QUANTIZED:
        # quantize once (DESIGN.md invariant 4): the bytes equal quantizing the expected bf16
        # tensor once; quantize() itself is checked against tests/reference_quant.py
        expected = want.values
        if want.choices:  # the holders' values nearest what arrived, then exact bytes
            nearest = _nearest(want.choices, dequantize(value, t.dtype).cpu())
            expected = torch.where(want.data, nearest, 0.0).to(torch.bfloat16)
        ref = quantize(expected, t.dtype)
        got, ref_data = value.data.cpu().to(torch.float32), ref.data.to(torch.float32)
        same = (got == ref_data) | (torch.isnan(got) & torch.isnan(ref_data))
        if not bool(same.all()):
            return f"`{t.name}` on rank {rank}: quantized data differs at {(~same).nonzero()[0].tolist()}"
        scales = (value.scales, ref.scales) if t.dtype == "mxfp8" else (value.scale, ref.scale)
        if not torch.equal(_as_float(scales[0]), _as_float(scales[1])):
            return f"`{t.name}` on rank {rank}: quantization scales differ"
        return None
    got = value.cpu()
    ok = got == want.values
    for choice in want.choices:
        ok = ok | (got == choice)
    if not bool(ok.all()):
        diff = (~ok).nonzero()[0].tolist()
        return (f"`{t.name}` on rank {rank}: element {diff} is {got[tuple(diff)].item()}, "
                f"expected {want.values[tuple(diff)].item()}")
    return None
