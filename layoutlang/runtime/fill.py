"""Deterministic tensors from logical coordinates: fill a source, check a destination.

Every logical element of a key gets a value that depends only on (key, its
logical flat index), so a destination can be checked element by element on
any rank without seeing the source or the plan. Padding is NaN in sources (it
must never travel) and zero in destinations, but for a flat dim's (docs/language.md
14.9), which a refit never writes: it keeps what `empty_destination` put there.

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
quantized bytes with probability about 63/64 (fp8_b128 blocks as per-tensor
e4m3). The 4-bit formats keep two significant bits: neighbouring elements
share an e2m1 code about 7 % of the time (mxfp4 and nvfp4, measured on the
fill), so a misplaced element changes the bytes with probability about 0.93,
and a misplaced block of n elements escapes with about 0.07^n.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass

import torch

from layoutlang.ir import QUANTIZED, KeyRegion, TensorIR
from layoutlang.vocabulary import DTYPE
from layoutlang.modes import Run

from .quant import PLAIN_DTYPES, dequantize, quantize, tensors_of

MASK32 = 0xFFFFFFFF


def _coords(t: TensorIR, rank: int) -> list[torch.Tensor]:
    """Per dim, the logical coordinate of each local index (-1 where it is padding)."""
    out = []
    for n, dim_runs in zip(t.local_shape_at(rank), t.runs(rank)):
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


def regions(t: TensorIR) -> tuple[KeyRegion, ...]:
    """The keys `t` holds, each with its box: a v1 tensor is one key, the whole of it."""
    if t.regions is not None:
        return t.regions
    return (KeyRegion(t.key, tuple((0, n) for n in t.logical_shape), (), False),)


def key_axes(r: KeyRegion) -> list[int]:
    """The stored dim of each of the key's dims, in the key's order (LANGUAGE.md 8.2, 8.3):
    stacked dims are not the key's; a transposed key reads its two dims in reverse.

    >>> key_axes(KeyRegion("w", ((0, 1), (0, 4), (0, 8)), (0,), True))
    [2, 1]
    """
    dims = [d for d in range(len(r.box)) if d not in r.stacked]
    return dims[::-1] if r.transposed else dims


def _inside(r: KeyRegion, coords: list[torch.Tensor]) -> torch.Tensor:
    """Mask (broadcastable to the local shape) of the local elements in `r`'s box; padding is in no box."""
    dims = len(coords)
    inside = torch.ones([1] * dims, dtype=torch.bool)
    for d, (lo, hi) in enumerate(r.box):
        inside = inside & _view((coords[d] >= lo) & (coords[d] < hi), d, dims)
    return inside


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

    Each element takes the value of its key at its row-major flat index in that
    key, the key's coordinates being the stored ones minus the key box's corner
    taken in the key's order (`key_axes`); an element in no box is padding (0).
    A v1 tensor is one key whose box is the whole tensor (LANGUAGE.md 8.1).
    """
    coords = _coords(t, rank)
    dims = len(coords)
    out = torch.zeros(t.local_shape_at(rank), dtype=torch.float32)
    mask = torch.zeros(t.local_shape_at(rank), dtype=torch.bool)
    for r in regions(t):
        flat = torch.zeros([1] * dims, dtype=torch.int64)
        stride = 1
        for d in reversed(key_axes(r)):
            lo, hi = r.box[d]
            flat = flat + (_view(coords[d], d, dims) - lo).clamp_min(0) * stride
            stride *= hi - lo
        inside = _inside(r, coords)
        out = torch.where(inside, values(r.key, flat), out)
        mask = mask | inside
    return out, mask


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
    `kept`: None, or the mask of padding a refit leaves as it is (a flat dim's), which must
    still hold the NaN `empty_destination` put there;
    `choices`: empty when every element has one possible value; otherwise one
    tensor per distinct source shard, the value that shard would send (NaN
    where it holds nothing): where quantized source shards overlap and quantize
    differently, any holder's value is right, whichever sender the plan picked.
    """

    values: torch.Tensor
    data: torch.Tensor
    choices: tuple[torch.Tensor, ...] = ()
    kept: torch.Tensor | None = None


def _key_coordinates(r: KeyRegion, coords: list[torch.Tensor]) -> list[torch.Tensor]:
    """Per key dim, each local element's coordinate in the key (-1: not in the key), broadcastable
    to the local shape. A flat dim's key (docs/language.md 14.9) unravels its one stored dim: the
    key's elements lie there in row-major order."""
    dims = len(coords)
    if r.shape is not None:
        (lo, hi), c = r.box[0], coords[0]
        inside = (c >= lo) & (c < hi)
        offset = (c - lo).clamp_min(0)
        out, stride = [], 1
        for n in reversed(r.shape):
            out.append(torch.where(inside, (offset // stride) % n, -1))
            stride *= n
        return out[::-1]
    out = []
    for d in key_axes(r):
        lo, hi = r.box[d]
        c = coords[d]
        out.append(_view(torch.where((c >= lo) & (c < hi), c - lo, -1), d, dims))
    return out


def _locate(s: TensorIR, rank: int, rs: KeyRegion, rt: KeyRegion, dst_coords: list[torch.Tensor]):
    """(held, index), or None: which elements of key `rt.key` in the destination's local
    storage (coordinates `dst_coords`) source shard (s, rank) holds, and where in its storage.

    From the layouts alone, by key coordinate: the destination's region `rt` and the
    source's `rs` hold the same key; key dim j lies on stored dim key_axes(rt)[j]
    here and key_axes(rs)[j] there (a transposed side reverses them, a stacked dim is
    none of them; a flat dim's key lies row-major on its one dim, `_key_coordinates`).
    Per key dim, invert the shard's runs (key coordinate -> local index); a stacked
    source dim is the one local index that holds the key's stack index (none: the shard
    does not hold the key). `index` indexes the source's local storage and broadcasts to
    the destination's local shape.
    """
    src_coords = _coords(s, rank)
    index: list[torch.Tensor | None] = [None] * len(src_coords)
    for d in rs.stacked:
        found = (src_coords[d] == rs.box[d][0]).nonzero()
        if not len(found):
            return None
        index[d] = found[0, 0]
    held = _inside(rt, dst_coords)
    want = _key_coordinates(rt, dst_coords)
    if rs.shape is not None:  # a flat source: its one dim holds the key's row-major index
        flat, stride = torch.zeros((), dtype=torch.int64), 1
        for k, n in zip(reversed(want), reversed(rs.shape)):
            flat = flat + k.clamp_min(0) * stride
            stride *= n
        pairs = [(0, flat, rs.box[0])]
    else:
        pairs = [(ds, k, rs.box[ds]) for ds, k in zip(key_axes(rs), want)]
    for ds, k, (slo, shi) in pairs:
        sc = src_coords[ds]
        inverse = torch.full((shi - slo,), -1, dtype=torch.int64)
        mine = (sc >= slo) & (sc < shi)
        inverse[sc[mine] - slo] = torch.arange(sc.numel())[mine]
        local = torch.where(k >= 0, inverse[k.clamp(0, shi - slo - 1)], -1)
        held = held & (local >= 0)
        index[ds] = local.clamp_min(0)
    return held, tuple(index)


def expected_destination(t: TensorIR, rank: int, plan=None) -> Expected:
    """What `t` on `rank` must hold: the logical fill, or, from a quantized source, what the
    source shard holding each element has after its own quantization.

    Computed from the source LAYOUT (`plan.src`, the front end's IR: every
    source instance of each key `t` holds and every rank holding it), never from
    the plan's ops: the answer must not depend on the plan under test. A
    quantized source shard holds `source_tensor` (the fill of its local storage,
    quantized as stored: MXFP8 blocks along the STORAGE last dim, so a
    transposed source's blocks run along its key's first dim, LANGUAGE.md 8.3;
    fp8 scales per local tensor, all of a stacked tensor's local experts
    together) and sends it dequantized; each destination element is located in
    it by key and coordinate in the key (`_locate`).
    """
    wire = torch.bfloat16 if t.dtype in QUANTIZED else PLAIN_DTYPES[t.dtype]
    exact, mask = key_values(t, rank)
    index = plan.src.key_index if plan is not None else {}
    holders = [(s, rs, rt) for rt in regions(t) for s, rs in index.get(rt.key, ())]
    if not any(s.dtype in QUANTIZED for s, _, _ in holders):
        return Expected(exact.to(wire), mask, kept=_kept(t, rank))
    coords = _coords(t, rank)
    shards, seen, stored = [], set(), {}
    for s, rs, rt in holders:
        rs = rs or regions(s)[0]
        for q in s.ranks():
            runs = s.runs(q)
            if (id(s), runs, rt.key) in seen:  # a replica with the same runs holds the same bytes
                continue
            seen.add((id(s), runs, rt.key))
            found = _locate(s, q, rs, rt, coords)
            if found is None:
                continue
            held, where = found
            if s.dtype in QUANTIZED:
                if (id(s), runs) not in stored:
                    stored[(id(s), runs)] = dequantize(source_tensor(s, q), s.dtype).to(torch.float32)
                sent = stored[(id(s), runs)][where]
            else:
                sent = exact  # a plain shard sends the exact values
            shards.append((held, sent))
    want = torch.full(t.local_shape_at(rank), float("nan"))
    for held, sent in shards:
        want = torch.where(held & torch.isnan(want), sent, want)
    missing = mask & torch.isnan(want)
    if missing.any():
        raise ValueError(f"`{t.name}` on rank {rank}: no source shard holds local element "
                         f"{missing.nonzero()[0].tolist()}")
    want = torch.where(mask, want, 0.0)
    ambiguous = any(bool((held & (sent != want)).any()) for held, sent in shards)
    choices = tuple(torch.where(held, sent, float("nan")).to(wire).expand(t.local_shape_at(rank))
                    for held, sent in shards) if ambiguous else ()
    return Expected(want.to(wire), mask, choices, kept=_kept(t, rank))


def _kept(t: TensorIR, rank: int) -> torch.Tensor | None:
    """Mask of the local padding a refit leaves as it is (a flat dim's: `TensorIR.zeroed_padding`),
    None where there is none."""
    if not any(dim.flat for dim in t.dims):
        return None
    shape = t.local_shape_at(rank)
    kept = torch.zeros([1] * len(shape), dtype=torch.bool)
    for d, (n, dim, runs) in enumerate(zip(shape, t.dims, t.runs(rank))):
        if dim.flat:
            pad = torch.zeros(n, dtype=torch.bool)
            for r in runs:
                if not isinstance(r, Run):
                    pad[r.local_start:r.local_start + r.length] = True
            kept = kept | _view(pad, d, len(shape))
    return kept.expand(shape)


def empty_destination(t: TensorIR, device="cpu", rank: int | None = None):
    """Garbage-filled destination storage of the right shape and dtype (NaN where it can;
    quantized: 3.0, never a fill value). `rank`: whose shape, where a dim is ragged."""
    shape = t.local_shape if rank is None else t.local_shape_at(rank)
    if t.dtype in QUANTIZED:
        return quantize(torch.full(shape, 3.0, dtype=torch.bfloat16, device=device), t.dtype)
    return torch.full(shape, float("nan"), dtype=PLAIN_DTYPES[t.dtype], device=device)


def _nearest(choices: tuple[torch.Tensor, ...], target: torch.Tensor) -> torch.Tensor:
    """Per element, the choice nearest `target` (what a quantized destination decodes to)."""
    stack = torch.stack([c.to(torch.float32) for c in choices])
    distance = torch.nan_to_num((stack - target.to(torch.float32)).abs(), nan=float("inf"))
    return stack.gather(0, distance.argmin(0, keepdim=True))[0]


def _raw(x: torch.Tensor) -> torch.Tensor:
    """The bytes of a tensor, row-major (codes of fp8/e2m1/e8m0 data and scales, fp32 scales' bits)."""
    flat = x.detach().cpu().reshape(-1).clone(memory_format=torch.contiguous_format)  # a size-1 dim keeps its stride
    return flat.view(torch.uint8)


def check_destination(t: TensorIR, rank: int, value, plan=None) -> str | None:
    """None if `value` holds what the layouts promise; else what is wrong.

    `plan` is used only for its source layout (`plan.src`), never for its ops;
    without it the source is taken to be plain.
    """
    want = expected_destination(t, rank, plan)
    local = tuple(t.local_shape_at(rank))
    shape = tuple((value.data if t.dtype in QUANTIZED else value).shape)
    stored = DTYPE[t.dtype].data_shape(local)  # packed e2m1: the last dim holds two per byte
    if shape != stored:
        return f"`{t.name}` on rank {rank}: local shape {shape}, expected {stored}"
    if t.dtype in QUANTIZED:
        # quantize once (DESIGN.md invariant 4): the bytes equal quantizing the expected bf16
        # tensor once; quantize() itself is checked against tests/reference_quant.py
        expected = want.values
        if want.choices:  # the holders' values nearest what arrived, then exact bytes
            nearest = _nearest(want.choices, dequantize(value, t.dtype).cpu())
            expected = torch.where(want.data, nearest, 0.0).to(torch.bfloat16)
        ref = quantize(expected, t.dtype)
        got, ref_data = _raw(value.data), _raw(ref.data)
        if not torch.equal(got, ref_data):
            at = (got != ref_data).nonzero()[0, 0].item()
            index = [int(i) for i in torch.unravel_index(torch.tensor(at), stored)] if stored else []
            if index:
                index[-1] *= DTYPE[t.dtype].per_byte  # the element (the first of a packed pair)
            return f"`{t.name}` on rank {rank}: quantized data differs at {index}"
        if not all(torch.equal(_raw(a), _raw(b)) for a, b in zip(tensors_of(value)[1:], tensors_of(ref)[1:])):
            return f"`{t.name}` on rank {rank}: quantization scales differ"
        return None
    got = value.cpu()
    ok = got == want.values
    if want.kept is not None:  # a flat dim's padding: left as it was (NaN)
        ok = torch.where(want.kept, torch.isnan(got), ok)
    for choice in want.choices:
        ok = ok | (got == choice)
    if not bool(ok.all()):
        diff = (~ok).nonzero()[0].tolist()
        return (f"`{t.name}` on rank {rank}: element {diff} is {got[tuple(diff)].item()}, "
                f"expected {want.values[tuple(diff)].item()}")
    return None
