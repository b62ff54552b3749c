"""Steady refits with every source changed in place (issue 49 item 0): the layouts, the expected
values, and the worker that tests/test_steady_inplace.py launches on gloo ranks.

`launch(job, n, program=__file__)` runs this as `python steady_inplace_program.py JOB.json
OUT.json` (tests/bridge_program.py's frame). Each rank builds its source tensors once and, in
each of the job's steps, writes new values into them IN PLACE (`copy_`: the same storage, so a
steady Refitter replays its record from step 3 on), refits three pairs and checks every element
of every destination tensor it holds:

- `plain`: TRAIN -> ENGINE, bf16: a block-strided GTP source (`chunk gtp align 3` of grouped
  q|k|v part keys: q's rows are 2 of every 4, a (count, block) view), a transposed source whose
  key rows are blocked too, stacked experts on both sides, padding on both sides, a tensor held
  by one trainer rank that engine replicas relay;
- `strided`: the same pair with every caller tensor a non-contiguous view (every other element
  of a buffer whose other elements are guards that must stay untouched), in overlapped buckets;
- `fallback`: `plain` again, with no copy allowed a common view of its two ends
  (`views.aligned` answers None, as it does where neither end's dims merge into the other's and
  they share no refinement, which no plan above reaches): every copy goes through the
  reshaping fallback, recorded as such (`reshape`) and replayed;
- `quantized`: TRAIN -> ENGINE_Q, mxfp8 and fp8_e4m3 destinations (packed wire, relays of packed
  bytes, per-tensor amax agreement, quantize-once): compared with tests/reference_quant.py.

Expected values never come from the code under test: every tensor's storage is written below as
the reference enumerator's modes (tests/reference_enumerator.py, from LANGUAGE.md 3 alone),
copied by hand from the layout text; keys, stacked dims and transposition are applied here.
"""

from __future__ import annotations

import functools
import itertools
import zlib
from dataclasses import dataclass

import torch

from reference_enumerator import Concat, Dim, MeshSpec, Pad, Plain, Product, dim_local
from reference_quant import quantize_fp8, quantize_mxfp8

TRAIN = """arg TP = 2
arg GTP = 2
mesh t (tp=TP, gtp=GTP)
tensor qkv [(16, (q: 2 as q | k: 1 as k | v: 1 as v)) over tp chunk gtp align 3, 32]
tensor emb [10 pad 8 over tp, 32]
tensor gate_up [32, (4, (gate: 2 as g | up: 2 as u))] transposed at tp=TP-1, gtp=GTP-1
tensor w2 as e.{e}.w2 [e in 0..4, 32, 6]
tensor norm [32, 32] at tp=0, gtp=0
for e in 0..4 over tp {
  tensor exp.{e.local} as e.{e} [6, 32]
}
"""

_ENGINE = """arg DP = 2
arg TP = 2
mesh e (dp=DP, tp=TP)
tensor wq as q [32 over tp, 32]{mx}
tensor wkv [(k: 16 as k | v: 16 as v) over tp, 32]{fp8}
tensor emb [10 pad 4 over tp, 32]{fp8}
tensor w13 [(gate: 8 as g | up: 8 as u), {w13}]{mx}
tensor experts as e.{{e}} [e in 0..4 over tp, 6, 32]{mx}
tensor norm [32, 32]{mx}
"""
ENGINE = _ENGINE.format(mx="", fp8="", w13="32 over tp") + """for e in 0..4 over tp {
  tensor down.{e.local} as e.{e}.w2 [32, 6]
}
"""
ENGINE_Q = _ENGINE.format(mx=" mxfp8", fp8=" fp8_e4m3", w13="32")  # (mxfp8: 32 local columns)

SOURCE_PAD = 99.0   # a source's padding: never sent
DEST_GARBAGE = 77.0  # a destination's elements before the first step: padding must come back zero
GUARD = -3.0         # the other elements of a strided caller tensor's buffer: never written


@dataclass(frozen=True)
class Stored:
    """One stored tensor written as the reference's modes: per storage dim a Dim, or a stack
    (`e in 0..n [over AXIS]`, ("stack", n, AXIS)); `parts` (dim, [(key, logical start)]) names
    each part key's logical range; `key` the tensor's key (`{e}`: the stack's index);
    `transposed`: the key's two dims are the storage's in reverse; `holds`: the mesh
    coordinates that store it; `dtype` its dtype."""

    name: str
    dims: tuple
    key: str | None = None
    parts: tuple = ()
    transposed: bool = False
    holds: tuple = ()
    dtype: str = "bf16"


def train_tensors(tp: int, gtp: int) -> list[Stored]:
    """TRAIN's tensors, from its text (the loop over tp: coordinate c holds experts [c*4/tp, ...))."""
    qkv = Product(16, Concat((("q", Plain(2)), ("k", Plain(1)), ("v", Plain(1)))))
    per = 4 // tp
    out = [
        # hoisted (LANGUAGE.md 3): all q rows (16 groups x 2), then all k (16), then all v (16)
        Stored("qkv", (Dim(qkv, over=("tp",), chunk="gtp", align=3), Dim(Plain(32))),
               parts=(0, (("q", 0), ("k", 32), ("v", 48)))),
        Stored("emb", (Dim(Pad(Plain(10), 8), over=("tp",)), Dim(Plain(32))), key="emb"),
        Stored("gate_up", (Dim(Plain(32)), Dim(Product(4, Concat((("gate", Plain(2)), ("up", Plain(2))))))),
               parts=(1, (("g", 0), ("u", 8))), transposed=True, holds=(("tp", tp - 1), ("gtp", gtp - 1))),
        Stored("w2", (("stack", 4, None), Dim(Plain(32)), Dim(Plain(6))), key="e.{e}.w2"),
        Stored("norm", (Dim(Plain(32)), Dim(Plain(32))), key="norm", holds=(("tp", 0), ("gtp", 0))),
    ]
    out += [Stored(f"exp.{e % per}", (Dim(Plain(6)), Dim(Plain(32))), key=f"e.{e}", holds=(("tp", e // per),))
            for e in range(4)]
    return out


def engine_tensors(tp: int, quantized: bool) -> list[Stored]:
    """ENGINE's (or ENGINE_Q's) tensors, from its text."""
    mx, fp8 = ("mxfp8", "fp8_e4m3") if quantized else ("bf16", "bf16")
    w13_cols = Dim(Plain(32)) if quantized else Dim(Plain(32), over=("tp",))
    out = [
        Stored("wq", (Dim(Plain(32), over=("tp",)), Dim(Plain(32))), key="q", dtype=mx),
        Stored("wkv", (Dim(Concat((("k", Plain(16)), ("v", Plain(16)))), over=("tp",)), Dim(Plain(32))),
               parts=(0, (("k", 0), ("v", 16))), dtype=fp8),
        Stored("emb", (Dim(Pad(Plain(10), 4), over=("tp",)), Dim(Plain(32))), key="emb", dtype=fp8),
        Stored("w13", (Dim(Concat((("gate", Plain(8)), ("up", Plain(8))))), w13_cols),
               parts=(0, (("g", 0), ("u", 8))), dtype=mx),
        Stored("experts", (("stack", 4, "tp"), Dim(Plain(6)), Dim(Plain(32))), key="e.{e}", dtype=mx),
        Stored("norm", (Dim(Plain(32)), Dim(Plain(32))), key="norm", dtype=mx),
    ]
    if not quantized:
        per = 4 // tp
        out += [Stored(f"down.{e % per}", (Dim(Plain(32)), Dim(Plain(6))), key=f"e.{e}.w2",
                       holds=(("tp", e // per),)) for e in range(4)]
    return out


KEY_COLUMNS = {"q": 32, "k": 32, "v": 32, "emb": 32, "g": 32, "u": 32, "norm": 32}  # else: e.{e} 32, e.{e}.w2 6


def value(key: str, coords: tuple[int, int], step: int) -> float:
    """Element `coords` of `key`'s logical tensor in `step`: a multiple of 1/8 in [-15, 15]
    (exact in bf16), different in every step, 241 apart in the key's row-major order."""
    cols = KEY_COLUMNS.get(key, 6 if key.endswith(".w2") else 32)
    n = coords[0] * cols + coords[1]
    return ((n * 7 + zlib.crc32(key.encode()) % 97 + step * 53) % 241 - 120) / 8


def _dim_entries(d, sizes: dict, coords: dict) -> list:
    """Per local index along one storage dim: its logical index (None: padding) or, for a
    stack, ("e", index)."""
    if isinstance(d, tuple):
        _, n, axis = d
        if axis is None:
            return [("e", i) for i in range(n)]
        per = n // sizes[axis]
        return [("e", i) for i in range(coords[axis] * per, (coords[axis] + 1) * per)]
    return dim_local(d, sizes, coords)


def local_values(t: Stored, mesh: MeshSpec, rank: int, step: int, pad: float) -> torch.Tensor | None:
    """`t`'s local tensor on `rank` in `step` (fp32; `pad` where the storage is padding), or None
    where the rank does not hold it."""
    coords = mesh.coords(rank)
    if coords is None or any(coords[a] != c for a, c in t.holds):
        return None
    entries = [_dim_entries(d, mesh.sizes, coords) for d in t.dims]
    part_dim, parts = t.parts if t.parts else (None, ())
    out = []
    for at in itertools.product(*entries):
        if any(x is None for x in at):
            out.append(pad)
            continue
        e = next((x[1] for x in at if isinstance(x, tuple)), None)
        logical = [x for x in at if not isinstance(x, tuple)]
        key = t.key.format(e=e) if t.key else None
        if part_dim is not None:
            i = part_dim - sum(1 for d in t.dims[:part_dim] if isinstance(d, tuple))
            key, start = [(k, s) for k, s in parts if s <= logical[i]][-1]
            logical[i] -= start
        if t.transposed:
            logical = logical[::-1]
        out.append(value(key, tuple(logical), step))
    return torch.tensor(out, dtype=torch.float32).reshape([len(x) for x in entries])


def mesh_of(side: str, args: dict) -> MeshSpec:
    if side == "src":
        return MeshSpec("t", (("tp", args["TP"]), ("gtp", args["GTP"])))
    return MeshSpec("e", (("dp", args["DP"]), ("tp", args["TP"])))


@functools.lru_cache(maxsize=None)
def _mxfp8_row(row: tuple[float, ...]) -> tuple[list[int], list[int]]:
    """One row's mxfp8 codes and scales (the reference is exact and slow; replicas repeat rows)."""
    ref = quantize_mxfp8([list(row)])
    return ref.codes[0], ref.scales[0]


def destination_problems(t: Stored, got, expected: torch.Tensor, where: str) -> list[str]:
    """Every element of a destination against its expected bf16 values (padding 0): a plain one
    exactly, a quantized one code by code and scale by scale against tests/reference_quant.py."""
    if t.dtype == "bf16":
        bad = (got.float() != expected).nonzero().tolist()
        return [f"{where} `{t.name}`: {len(bad)} elements differ, first at {bad[0]}: {got.float()[tuple(bad[0])]} "
                f"!= {expected[tuple(bad[0])]}"] if bad else []
    rows = expected.reshape(-1, expected.shape[-1]).tolist()
    data = got.data.view(torch.uint8)
    if t.dtype == "mxfp8":
        refs = [_mxfp8_row(tuple(row)) for row in rows]
        problems = []
        if data.reshape(len(rows), -1).tolist() != [codes for codes, _ in refs]:
            problems.append(f"{where} `{t.name}`: mxfp8 codes differ from the reference")
        if got.scales.view(torch.uint8).reshape(len(rows), -1).tolist() != [scales for _, scales in refs]:
            problems.append(f"{where} `{t.name}`: mxfp8 scales differ from the reference")
        return problems
    ref = quantize_fp8([v for row in rows for v in row], t.dtype)
    problems = []
    if data.reshape(-1).tolist() != ref.codes:
        problems.append(f"{where} `{t.name}`: {t.dtype} codes differ from the reference")
    if got.scale.item() != ref.scale:
        problems.append(f"{where} `{t.name}`: {t.dtype} scale {got.scale.item()} != {ref.scale}")
    return problems


def strided_like(t: torch.Tensor, guards: list) -> torch.Tensor:
    """A non-contiguous tensor of `t`'s shape and dtype: every other element of the last dim
    of a buffer whose other elements hold GUARD (kept in `guards` to be checked)."""
    big = torch.full(tuple(t.shape[:-1]) + (2 * t.shape[-1],), GUARD, dtype=t.dtype)
    guards.append(big)
    view = big[..., ::2]
    view.copy_(t)
    return view


def body(job: dict, rank: int) -> dict:
    from layoutlang.compiler import compile_plan
    from layoutlang.runtime import Refitter, bucket
    from layoutlang.runtime.quant import empty

    args, world = job["args"], job["world"]
    src_args, dst_args = {"TP": args["TP"], "GTP": args["GTP"]}, {"DP": args["DP"], "TP": args["TP"]}
    smesh, dmesh = mesh_of("src", args), mesh_of("dst", args)
    plans = {name: compile_plan(job["train"], job[layout], src_args=src_args, dst_args=dst_args)
             for name, layout in (("plain", "engine"), ("quantized", "engine_q"))}
    refitters = {"plain": Refitter(plans["plain"], steady=True, timeout=30),
                 "strided": Refitter(plans["plain"], steady=True, timeout=30, overlap=True, budget_bytes=4096),
                 "fallback": Refitter(plans["plain"], steady=True, timeout=30),
                 "quantized": Refitter(plans["quantized"], steady=True, timeout=30)}
    sources = [t for t in train_tensors(args["TP"], args["GTP"]) if local_values(t, smesh, rank, 0, 0.0) is not None]
    src = {t.name: local_values(t, smesh, rank, 0, SOURCE_PAD).to(torch.bfloat16) for t in sources}
    guards: list[torch.Tensor] = []
    strided_src = {name: strided_like(v, guards) for name, v in src.items()}
    engines = {"plain": engine_tensors(args["TP"], False), "quantized": engine_tensors(args["TP"], True)}
    engines["strided"] = engines["fallback"] = engines["plain"]
    dst: dict[str, dict] = {}
    for name, tensors in engines.items():
        dst[name] = {}
        for t in tensors:
            shape = local_values(t, dmesh, rank, 0, 0.0)
            if shape is None:
                continue
            if t.dtype == "bf16":
                v = torch.full(tuple(shape.shape), DEST_GARBAGE, dtype=torch.bfloat16)
                dst[name][t.name] = strided_like(v, guards) if name == "strided" else v
            else:
                dst[name][t.name] = empty(t.dtype, tuple(shape.shape))
    problems: list[str] = []
    checked = 0
    for step in range(1, job["steps"] + 1):
        for t in sources:  # new values, written into the same storage
            fresh = local_values(t, smesh, rank, step, SOURCE_PAD).to(torch.bfloat16)
            src[t.name].copy_(fresh)
            strided_src[t.name].copy_(fresh)
        for name, refitter in refitters.items():
            given = strided_src if name == "strided" else src
            if name == "fallback":  # (recording happens while walking: replays never call it)
                common, bucket.aligned = bucket.aligned, lambda target, source: None
            try:
                refitter.refit(given or None, dst[name] or None)
            finally:
                if name == "fallback":
                    bucket.aligned = common
            for t in engines[name]:
                expected = local_values(t, dmesh, rank, step, 0.0)
                if expected is not None:  # (`down.0` is e.0's on tp 0 and e.2's on tp 1)
                    problems += destination_problems(t, dst[name][t.name], expected, f"step {step} {name}")
                    checked += 1
    for big in guards:
        if not bool((big[..., 1::2] == GUARD).all()):
            problems.append("an element outside a strided tensor's view was written")
    return {"problems": problems[:12], "checked": checked, "world": world,
            "replayed": {name: r.replayed for name, r in refitters.items()},
            "recorded": {name: sorted({a[0] for a in r._record.actions}) if r._record else []
                         for name, r in refitters.items()}}


if __name__ == "__main__":
    from bridge_program import run

    run(body)
