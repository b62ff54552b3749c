"""A naive per-(tensor, rank) planner: the SAME algorithm as layoutlang.compiler, no templates.

The baseline that `plan_scale.py` measures the real planner against, and a
reference that checks it. For every destination instance and every destination
rank that holds it, the destination runs (`t.runs(rank)`) are intersected, dim by
dim in logical coordinates, with the runs of every rank that holds every source
instance of the key; identical rectangles found on several source ranks form a
replica set (found by scanning ranks, not from mesh axes); the first source
instance tiles the destination, the others are offered as alternatives where
one rank holds a whole piece; pieces of one destination shard that continue in
its storage and in every alternative's are joined (rotary halves of consecutive
heads: logically apart, one copy in storage); and a sender is picked op by op, in canonical
order (destination instance, destination rank, piece), with the balanced rule:
the receiver itself if it holds the piece, then a rank on its node, then the
least-loaded candidate so far, ties to the lowest rank. Nothing is shared
between layers, experts or ranks: no templates, no memoized shards.

Keys inside stored tensors (LANGUAGE.md 8: part keys, stacked dims, `transposed`):
each (destination instance, key) is planned on its own, in the key's coordinates:
every side's runs are restricted to the key's box in its stored tensor
(`key_runs`: clipped, re-based to the key, a stacked dim kept aside as the local
index that holds the key, the two dims of a transposed key swapped), and each
slice is put back in its stored tensor's storage order. One op never mixes keys.

Differences from the real planner, by design: the real planner batches its
sender choice per template (all identical layers of one request at once), this
one picks op by op, so senders may differ while the pieces, op ids, bytes and
candidate sets must not; and a destination rectangle that several DIFFERENT
source slices can feed is one piece here with every holder as a candidate.

    .venv/bin/python benchmarks/naive_planner.py --selfcheck

compares it with `layoutlang.compiler.compile_plan` on the Llama-3-8B example
pairs (fused tensors with part keys on both sides), two small DeepSeek-V3-style
MoE pairs, stacked FusedMoE experts and transposed GPT-2 Conv1D weights
(examples/small/v2/): the same ops in the same order
(id, key, destination rank, name and slice, bytes), the same candidate senders,
and every real op's sender holding its source slice.
"""

from __future__ import annotations

import argparse
import itertools
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from layoutlang.gcpause import gc_paused
from layoutlang import load
from layoutlang.ir import ELEMENT_BYTES, QUANTIZED, KeyRegion, Layout, Run, TensorIR

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"

Slice = tuple[tuple[int, int], ...]


@dataclass(frozen=True)
class NaiveOp:
    id: int
    key: str
    src_rank: int
    dst_rank: int
    src_name: str
    dst_name: str
    src_slice: Slice
    dst_slice: Slice
    bytes: int
    candidates: tuple[int, ...]


class NaiveError(Exception):
    pass


# ---- one dim: intersection in logical coordinates ---------------------------------

def intersect(dst_runs, src_runs) -> list[tuple[int, int, int, int]]:
    """(dst_start, src_start, logical_start, length) where both hold the same logical
    elements; pairwise over data runs, sorted by destination, merged when the
    destination, the source and the logical index all continue."""
    found = []
    for a in dst_runs:
        if not isinstance(a, Run):
            continue
        for b in src_runs:
            if not isinstance(b, Run):
                continue
            lo = max(a.logical_start, b.logical_start)
            hi = min(a.logical_start + a.length, b.logical_start + b.length)
            if lo < hi:
                found.append((a.local_start + lo - a.logical_start,
                              b.local_start + lo - b.logical_start, lo, hi - lo))
    found.sort()
    merged: list[tuple[int, int, int, int]] = []
    for d, s, g, n in found:
        if merged:
            md, ms, mg, mn = merged[-1]
            if md + mn == d and ms + mn == s and mg + mn == g:
                merged[-1] = (md, ms, mg, mn + n)
                continue
        merged.append((d, s, g, n))
    return merged


def holds_whole(runs, lo: int, hi: int) -> int | None:
    """Local start of logical [lo, hi) if one data run of `runs` holds all of it."""
    for r in runs:
        if isinstance(r, Run) and r.logical_start <= lo and hi <= r.logical_start + r.length:
            return r.local_start + lo - r.logical_start
    return None


def data_elements(runs) -> int:
    n = 1
    for dim in runs:
        n *= sum(r.length for r in dim if isinstance(r, Run))
    return n


# ---- a key inside a stored tensor (LANGUAGE.md 8) ------------------------------------

def key_runs(t: TensorIR, region: KeyRegion | None, rank: int):
    """(runs per KEY dim, stacked local index per STORED dim or None) of `t` on `rank`,
    restricted to one key: data runs clipped to the key's box and re-based to the key's
    logical coordinates; a stacked dim holds the key at one local index (kept aside, not a
    dim of the key); a transposed key's two dims swapped. A v1 tensor (region None) is its
    runs as they are. None when the rank holds none of the key."""
    runs = t.runs(rank)
    if region is None:
        return runs, None
    dims, fixed = [], []
    for i, (dim_runs, (lo, hi)) in enumerate(zip(runs, region.box)):
        clipped = []
        for r in dim_runs:
            if isinstance(r, Run):
                a, b = max(lo, r.logical_start), min(hi, r.logical_start + r.length)
                if a < b:
                    clipped.append(Run(r.local_start + a - r.logical_start, a - lo, b - a))
        if not clipped:
            return None
        if i in region.stacked:
            if len(clipped) != 1 or clipped[0].length != 1:
                raise NaiveError(f"{t.name}: stacked dim {i} holds {clipped} of one key")
            fixed.append(clipped[0].local_start)
        else:
            dims.append(tuple(clipped))
            fixed.append(None)
    return tuple(dims[::-1] if region.transposed else dims), tuple(fixed)


def stored_slice(key_slice: Slice, fixed, region: KeyRegion | None) -> Slice:
    """A slice in a key's dims, put back in its stored tensor's dims (stacked dims: extent 1)."""
    if region is None:
        return key_slice
    it = iter(key_slice[::-1] if region.transposed else key_slice)
    return tuple((f, f + 1) if f is not None else next(it) for f in fixed)


def key_shape(t: TensorIR, region: KeyRegion | None) -> tuple[int, ...]:
    return t.logical_shape if region is None else region.key_shape


def volume(sl: Slice) -> int:
    n = 1
    for a, b in sl:
        n *= b - a
    return n


# ---- merging pieces whose storages continue ---------------------------------------

def _joined(p, q, d: int):
    """p then q as one piece along dim d, if q continues p there in the destination's storage,
    both are equal along every other dim, and they have the same alternatives (instance and
    holder ranks), each continuing in its source's storage; else None."""
    (pd, pa), (qd, qa) = p, q
    rest = lambda sl: sl[:d] + sl[d + 1:]  # noqa: E731
    if pd[d][1] != qd[d][0] or rest(pd) != rest(qd) or len(pa) != len(qa):
        return None
    pk = sorted((inst, tuple(ranks), sl) for (inst, sl), ranks in pa.items())
    qk = sorted((inst, tuple(ranks), sl) for (inst, sl), ranks in qa.items())
    alts = {}
    for (i, r, a), (j, s, b) in zip(pk, qk):
        if (i, r) != (j, s) or rest(a) != rest(b) or a[d][1] != b[d][0]:
            return None
        alts[(i, a[:d] + ((a[d][0], b[d][1]),) + a[d + 1:])] = list(r)
    return pd[:d] + ((pd[d][0], qd[d][1]),) + pd[d + 1:], alts


def _merged(found: list) -> list:
    """Pieces of one destination shard, those that continue in both storages joined: per dim in
    turn, in destination order, each joined to the one before it where it can be, until nothing
    joins (the real planner's rule, layoutlang/compiler/pieces.py `merge`, written out on plain slices)."""
    if len(found) < 2:
        return found
    changed = True
    while changed:
        changed = False
        for d in range(len(found[0][0])):
            out: list = []
            for piece in sorted(found, key=lambda pc: (pc[0][:d] + pc[0][d + 1:], pc[0][d])):
                joined = _joined(out[-1], piece, d) if out else None
                if joined is None:
                    out.append(piece)
                else:
                    out[-1], changed = joined, True
            found = out
    return sorted(found, key=lambda pc: pc[0])


# ---- the planner --------------------------------------------------------------------

class NaivePlan:
    def __init__(self, src: Layout, dst: Layout, *, selector: str = "balanced",
                 ranks_per_node: int | None = None,
                 dst_filter: Callable[[TensorIR], bool] | None = None,
                 timer: Callable[[TensorIR, float], None] | None = None):
        self.src, self.dst = src, dst
        self.world = max(src.ranks, dst.ranks)
        self.load = [0] * self.world
        self.recv = [0] * self.world
        self.ops: list[NaiveOp] = []
        self.usable: set[int] = set()
        by_key = src.key_index  # key -> ((stored source instance, its region or None), ...)
        for t in dst.tensors:
            if dst_filter is not None and not dst_filter(t):
                continue
            start = time.perf_counter()
            wire = ELEMENT_BYTES["bf16" if t.dtype in QUANTIZED else t.dtype]
            for region in (None,) if t.regions is None else t.regions:
                key = t.key if region is None else region.key
                sources = by_key.get(key)
                if not sources:
                    raise NaiveError(f"key {key} is not in the source")
                if key_shape(t, region) != key_shape(*sources[0]):
                    raise NaiveError(f"{key}: logical shape {key_shape(t, region)} != {key_shape(*sources[0])}")
                ordinal = 0  # the request's position within this key (round robin restarts per key)
                for rank in sorted(t.ranks()):
                    held = key_runs(t, region, rank)
                    if held is None:
                        continue
                    for dst_slice, alts in self._pieces(t, region, rank, held, sources):
                        cands = sorted({q for ranks in alts.values() for q in ranks})
                        nbytes = volume(dst_slice) * wire
                        sender = self._pick(selector, ranks_per_node, rank, cands, nbytes, ordinal)
                        ordinal += 1
                        inst, src_slice = next(a for a, ranks in alts.items() if sender in ranks)
                        self.usable.update(cands)
                        self.recv[rank] += nbytes
                        self.ops.append(NaiveOp(len(self.ops), key, sender, rank, sources[inst][0].name,
                                                t.name, src_slice, dst_slice, nbytes, tuple(cands)))
            if timer is not None:
                timer(t, time.perf_counter() - start)

    def _pieces(self, t: TensorIR, region, rank: int, held, sources):
        """[(dst_slice, {(instance, src_slice): [ranks]})] for one destination rank and key, sorted;
        slices in STORED coordinates, intersections in the key's."""
        druns, dfixed = held
        groups: dict[Slice, tuple[Slice, dict]] = {}
        first, first_region = sources[0]
        for q in first.ranks():
            s = key_runs(first, first_region, q)
            if s is None:
                continue
            sruns, sfixed = s
            per_dim = [intersect(d, r) for d, r in zip(druns, sruns)]
            if any(not segs for segs in per_dim):
                continue
            for rect in itertools.product(*per_dim):
                dst_slice = stored_slice(tuple((d, d + n) for d, _, _, n in rect), dfixed, region)
                logical = tuple((g, g + n) for _, _, g, n in rect)
                src_slice = stored_slice(tuple((s, s + n) for _, s, _, n in rect), sfixed, first_region)
                _, alts = groups.setdefault(dst_slice, (logical, {}))
                alts.setdefault((0, src_slice), []).append(q)
        for inst in range(1, len(sources)):
            other, other_region = sources[inst]
            for q in other.ranks():
                s = key_runs(other, other_region, q)
                if s is None:
                    continue
                sruns, sfixed = s
                for dst_slice, (logical, alts) in groups.items():
                    starts = [holds_whole(r, lo, hi) for r, (lo, hi) in zip(sruns, logical)]
                    if all(x is not None for x in starts):
                        src_slice = stored_slice(tuple((x, x + hi - lo) for x, (lo, hi) in zip(starts, logical)),
                                                 sfixed, other_region)
                        alts.setdefault((inst, src_slice), []).append(q)
        # exactly once: the pieces are disjoint and cover every data element of the key here
        rects = sorted(groups)
        covered = sum(volume(r) for r in rects)
        if covered != data_elements(druns):
            raise NaiveError(f"{t.name} on rank {rank}: pieces cover {covered} elements, "
                             f"the key holds {data_elements(druns)}")
        for a, b in itertools.combinations(rects, 2):
            if all(max(x0, y0) < min(x1, y1) for (x0, x1), (y0, y1) in zip(a, b)):
                raise NaiveError(f"{t.name} on rank {rank}: pieces {a} and {b} overlap")
        return _merged([(r, groups[r][1]) for r in rects])

    def _pick(self, selector, rpn, receiver, cands, nbytes, ordinal) -> int:
        if selector == "round_robin":
            r = cands[ordinal % len(cands)]
        elif receiver in cands:
            r = receiver
        else:
            near = [q for q in cands if rpn and q // rpn == receiver // rpn] or cands
            r = min(near, key=lambda q: (self.load[q], q))
        if r != receiver:
            self.load[r] += nbytes
        return r

    @property
    def stats(self) -> dict:
        total = sum(op.bytes for op in self.ops)
        floor = total / len(self.usable) if self.usable else 0.0
        busiest = max(range(self.world), key=lambda r: (self.load[r], -r)) if self.world else 0
        return {"ops": len(self.ops), "bytes": total, "max_send_bytes": self.load[busiest],
                "busiest_sender": busiest, "usable_senders": len(self.usable),
                "send_balance": self.load[busiest] / floor if floor else 0.0,
                "max_recv_bytes": max(self.recv, default=0)}


def naive_plan(src, dst, *, args=None, src_args=None, dst_args=None, **kw) -> NaivePlan:
    """Like compile_plan: paths or loaded layouts; args for both sides or one side."""
    common = dict(args or {})
    if not isinstance(src, Layout):
        src = load(src, {**common, **(src_args or {})}, unknown_args="ignore")
    if not isinstance(dst, Layout):
        dst = load(dst, {**common, **(dst_args or {})}, unknown_args="ignore")
    with gc_paused():  # the same treatment as the real planner gets: a fair comparison
        return NaivePlan(src, dst, **kw)


# ---- the self-check ----------------------------------------------------------------

PAIRS = [
    # (label, source, destination, args for both, source args, destination args)
    ("llama3-8B train TP8xGTP2xDP4 -> vLLM TP2xDP2 (collocated)",
     "llama3_8b_train.layout", "llama3_8b_infer.layout", {}, {}, {}),
    ("llama3-8B train -> vLLM TP2xDP2 at 64",
     "llama3_8b_train.layout", "llama3_8b_infer_offset.layout", {}, {}, {}),
    ("llama3-8B train -> vLLM TP16 at 64 (KV heads replicated)",
     "llama3_8b_train.layout", "llama3_8b_infer_tp16.layout", {}, {}, {}),
    ("llama3-8B train TP4xGTP2xDP2 -> vLLM TP8xDP2 at 8",
     "llama3_8b_train.layout", "llama3_8b_infer.layout", {},
     {"TP": 4, "GTP": 2, "DP": 2}, {"TP": 8, "DP": 2, "AT": 8}),
    ("DeepSeek-V3-style MoE, 10 layers x 8 experts: trainer 32 ranks -> engine 8 ranks, collocated",
     "deepseek_v3_moe.layout", "deepseek_v3_infer.layout", {"L": 10, "E": 8},
     {"TP": 2, "DP": 2, "EP": 2, "ETP": 2}, {"ENGINE_TP": 4, "ENGINE_DP": 2, "ENGINE_EP": 8, "ENGINE_ETP": 1}),
    ("DeepSeek-V3-style MoE, 10 layers x 8 experts: trainer 32 ranks -> engine EP4xETP2 at 32",
     "deepseek_v3_moe.layout", "deepseek_v3_infer.layout", {"L": 10, "E": 8},
     {"TP": 2, "DP": 2, "EP": 2, "ETP": 2}, {"ENGINE_TP": 4, "ENGINE_DP": 2, "ENGINE_EP": 4, "ENGINE_ETP": 2, "AT": 32}),
    ("small MoE, per-expert Megatron EP2xETP2 -> vLLM FusedMoE stacked w13/w2 EP4 at 4",
     "small/v2/moe_megatron.layout", "small/v2/moe_vllm.layout", {}, {}, {"AT": 4}),
    ("small GPT-2, HF Conv1D transposed -> TP2 [out, in] at 1",
     "small/v2/gpt2_hf.layout", "small/v2/gpt2_tp.layout", {}, {}, {"AT": 1}),
]


def compare(real, naive: NaivePlan) -> list[str]:
    """Differences between the real plan and the naive one (empty: they agree)."""
    problems: list[str] = []
    real_ops = real.ops
    if len(real_ops) != len(naive.ops):
        problems.append(f"{len(real_ops)} real ops, {len(naive.ops)} naive ops")
    want = {(o.dst_rank, o.dst_name, o.dst_slice) for o in naive.ops}
    got = {(o.dst_rank, o.dst_name, o.dst_slice) for o in real_ops}
    for label, diff in (("only in the real plan", got - want), ("only in the naive plan", want - got)):
        for item in sorted(diff)[:5]:
            problems.append(f"piece {label}: rank {item[0]} {item[1]}{list(item[2])}")
    # the same canonical order and ids, bytes and keys
    for r, n in zip(real_ops, naive.ops):
        if (r.id, r.key, r.dst_rank, r.dst_name, r.dst_slice, r.bytes) != \
           (n.id, n.key, n.dst_rank, n.dst_name, n.dst_slice, n.bytes):
            problems.append(f"op {r.id} differs: real {r} / naive {n}")
            break
    # the real sender is a candidate and holds the source slice it names
    cands = {(o.dst_rank, o.dst_name, o.dst_slice): o for o in naive.ops}
    src_index = real.src.key_index
    bad = 0
    for r in real_ops:
        n = cands.get((r.dst_rank, r.dst_name, r.dst_slice))
        if n is None:
            continue
        if r.src_rank not in n.candidates:
            problems.append(f"op {r.id}: sender {r.src_rank} is not among {n.candidates}")
            bad += 1
        else:
            holders = [(t, reg) for t, reg in src_index.get(r.key, ()) if t.name == r.src_name and t.holds(r.src_rank)]
            if not holders or not _feeds(*holders[0], r):
                problems.append(f"op {r.id}: rank {r.src_rank} {r.src_name}{list(r.src_slice)} "
                                f"does not hold the logical data of {r.dst_name}{list(r.dst_slice)}")
                bad += 1
        if bad >= 5:
            break
    # the candidate sets, through the plan's public door: every rank that could have sent each op
    real_cands = [tuple(t.senders) for t in real.transfers()]
    if len(real_cands) != len(naive.ops):
        problems.append(f"{len(real_cands)} real candidate sets, {len(naive.ops)} naive ops")
    for k, (rc, n) in enumerate(zip(real_cands, naive.ops)):
        if tuple(rc) != n.candidates:
            problems.append(f"op {k}: real candidates {rc}, naive {n.candidates}")
            break
    return problems


def _feeds(src_t: TensorIR, src_region, op) -> bool:
    """Does src_slice on the sender hold the same elements of the op's key as dst_slice?"""
    dst_t, dst_region = next((t, reg) for t, reg in _DST_CACHE if t.name == op.dst_name and
                             (reg.key if reg is not None else t.key) == op.key and t.holds(op.dst_rank))
    a = _key_box(src_t, src_region, op.src_rank, op.src_slice)
    return a is not None and a == _key_box(dst_t, dst_region, op.dst_rank, op.dst_slice)


def _key_box(t: TensorIR, region, rank: int, sl: Slice):
    """The elements of the key (per dim, in its dims: the logical segments, in storage order) that
    stored slice `sl` holds, or None if an element of it is padding or outside the key."""
    box = []
    for i, (runs, (a, b)) in enumerate(zip(t.runs(rank), sl)):
        segs = _logical(runs, a, b)
        if segs is None:
            return None
        if region is not None:
            rlo, rhi = region.box[i]
            if not all(rlo <= lo and hi <= rhi for lo, hi in segs):
                return None
            if i in region.stacked:
                continue
            segs = [(lo - rlo, hi - rlo) for lo, hi in segs]
        box.append(_joined_segments(segs))
    return tuple(box[::-1] if region is not None and region.transposed else box)


def _logical(runs, lo, hi):
    """The logical [start, stop) segments of local [lo, hi), in local order, if data runs hold
    every element of it, else None."""
    segs, at = [], lo
    for r in sorted((r for r in runs if isinstance(r, Run)), key=lambda r: r.local_start):
        a, b = max(at, r.local_start), min(hi, r.local_start + r.length)
        if a < b:
            if a != at:
                return None
            segs.append((r.logical_start + a - r.local_start, r.logical_start + b - r.local_start))
            at = b
    return segs if at == hi else None


def _joined_segments(segs):
    """Adjacent logical segments joined: one element order, one way to write it."""
    out: list[tuple[int, int]] = []
    for lo, hi in segs:
        if out and out[-1][1] == lo:
            out[-1] = (out[-1][0], hi)
        else:
            out.append((lo, hi))
    return tuple(out)


_DST_CACHE: list[tuple[TensorIR, KeyRegion | None]] = []  # the destination's (instance, region) pairs


def dst_items(layout: Layout) -> list[tuple[TensorIR, KeyRegion | None]]:
    return [item for items in layout.key_index.values() for item in items]


def selfcheck() -> int:
    from layoutlang.compiler import compile_plan

    failed = 0
    for label, s, d, common, sa, da in PAIRS:
        src = load(EXAMPLES / s, {**common, **sa}, unknown_args="ignore")
        dst = load(EXAMPLES / d, {**common, **da}, unknown_args="ignore")
        t0 = time.perf_counter()
        try:
            real = compile_plan(src, dst, wire="bf16")  # the naive planner models the bf16 wire (LANGUAGE.md 4)
            real.ops
        except Exception as e:  # noqa: BLE001 - report and go on
            print(f"FAIL {label}: the real planner raised {type(e).__name__}: {e}")
            failed += 1
            continue
        t1 = time.perf_counter()
        naive = NaivePlan(src, dst)
        t2 = time.perf_counter()
        _DST_CACHE[:] = dst_items(dst)
        problems = compare(real, naive)
        rs, ns = real.stats, naive.stats
        status = "ok  " if not problems else "FAIL"
        failed += bool(problems)
        print(f"{status} {label}: {len(naive.ops)} ops, {ns['bytes']} B; real {t1 - t0:.2f} s, "
              f"naive {t2 - t1:.2f} s; busiest sender real {rs['send_balance']:.3f}x, "
              f"naive {ns['send_balance']:.3f}x floor")
        for p in problems[:12]:
            print("     " + p)
    print("selfcheck:", "all pairs agree" if not failed else f"{failed} pair(s) differ")
    return 1 if failed else 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--selfcheck", action="store_true",
                        help="compare with the real planner on small example pairs")
    parser.add_argument("src", nargs="?")
    parser.add_argument("dst", nargs="?")
    parser.add_argument("--selector", default="balanced", choices=("balanced", "round_robin"))
    ns = parser.parse_args(argv)
    if ns.selfcheck:
        return selfcheck()
    if not (ns.src and ns.dst):
        parser.error("give SRC DST, or --selfcheck")
    t0 = time.perf_counter()
    plan = naive_plan(ns.src, ns.dst, selector=ns.selector)
    print(f"naive plan: {plan.stats} in {time.perf_counter() - t0:.2f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
