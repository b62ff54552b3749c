"""Uneven placements (`over AXIS balanced | cyclic`) and tables (`arg MAP = [[...]]`,
`MAP[l][p]`), docs/language.md 14.8: vLLM's expert placements and EPLB's physical -> logical map.

Expected values are written out from the rules in docs/language.md 14.8 (numpy.array_split's
blocks; round-robin c, c+s, ...; a physical slot holds the logical expert its table entry
names), never read back from the front end. The refits run every rank in one process
(layoutlang/runtime/loopback.py: the Refitter's own step handlers) and compare each destination slot
with the expert the test itself filled in, by formula.
"""

from __future__ import annotations

import random

import pytest
import torch

from layoutlang import LayoutError, loads
from layoutlang.compiler import compile_plan
from layoutlang.fmt import format_text
from layoutlang.runtime import loopback


def _held(text: str, **args) -> dict[int, list[int]]:
    """Per rank of the first tensor's mesh: the logical indices of dim 0 it stores, in local order."""
    t = loads(text, "t.layout", args or None).tensors[0]
    out = {}
    for r in t.ranks():
        out[r] = [run.logical_start + i for run in t.runs(r)[0] for i in range(run.length)]
    return out


# ---- placements: what each coordinate holds ------------------------------------------------------

@pytest.mark.parametrize("dim, expected", [
    # round-robin: coordinate c holds c, c+4, c+8, ...
    ("x in 0..10 over ep cyclic", {0: [0, 4, 8], 1: [1, 5, 9], 2: [2, 6], 3: [3, 7]}),
    # array_split: 10 = 3 + 3 + 2 + 2, the longer blocks first
    ("x in 0..10 over ep balanced", {0: [0, 1, 2], 1: [3, 4, 5], 2: [6, 7], 3: [8, 9]}),
    ("10 over ep balanced", {0: [0, 1, 2], 1: [3, 4, 5], 2: [6, 7], 3: [8, 9]}),
    # fewer than the coordinates: the last ones hold nothing
    ("x in 0..3 over ep balanced", {0: [0], 1: [1], 2: [2], 3: []}),
    ("x in 0..3 over ep cyclic", {0: [0], 1: [1], 2: [2], 3: []}),
    # divisible: balanced is the equal split, cyclic still strides
    ("x in 0..8 over ep balanced", {0: [0, 1], 1: [2, 3], 2: [4, 5], 3: [6, 7]}),
    ("x in 0..8 over ep cyclic", {0: [0, 4], 1: [1, 5], 2: [2, 6], 3: [3, 7]}),
    # a product cuts its copies (of 2 rows each): copies 0, 4 | 1 | 2 | 3
    ("(5, 2) over ep cyclic", {0: [0, 1, 8, 9], 1: [2, 3], 2: [4, 5], 3: [6, 7]}),
    # a concatenation splits each part: gate 0..5 and up 5..10, 5 = 2 + 1 + 1 + 1
    ("(gate: 5 | up: 5) over ep balanced", {0: [0, 1, 5, 6], 1: [2, 7], 2: [3, 8], 3: [4, 9]}),
])
def test_each_coordinate_holds_what_the_rule_says(dim, expected):
    key = " as w.{x}" if dim.startswith("x in") else ""
    assert _held(f"mesh m (ep=4)\ntensor w{key} [{dim}, 2]") == expected


def test_local_shapes_differ_by_coordinate_and_bytes_count_each():
    layout = loads("mesh m (ep=4)\ntensor w as w.{x} [x in 0..10 over ep cyclic, 8]")
    t = layout.tensors[0]
    assert [t.local_shape_at(r) for r in range(4)] == [(3, 8), (3, 8), (2, 8), (2, 8)]
    assert layout.bytes_per_rank() == [3 * 8 * 2, 3 * 8 * 2, 2 * 8 * 2, 2 * 8 * 2]


def test_an_equal_chunk_of_an_uneven_split_is_an_error_naming_the_placement():
    with pytest.raises(LayoutError) as err:
        loads("mesh m (ep=4, etp=2)\ntensor w [10 over ep cyclic chunk etp, 2]", "c.layout")
    text = err.value.render()
    assert "c.layout:2:29: error: `chunk etp` cuts equal chunks, but `over ... cyclic` leaves" in text
    assert "help: write `chunk etp ragged`" in text


@pytest.mark.parametrize("text", [
    "mesh m (ep=4)\ntensor w as w.{x} [x in 0..10 over ep cyclic, 8]\n",
    "mesh m (ep=4, tp=2)\ntensor w [(a: 6 | b: 6) over (ep, tp) balanced, 8]\n",
    "arg MAP = [[0, 1], [1, 0]]\nconst P = len(MAP[0]), Q = MAP[1][0] + 1\n",
    "const T = [2, [3, 4], []]\n",
])
def test_the_formatter_keeps_placements_and_tables(text):
    assert format_text(text) == text


# ---- tables ---------------------------------------------------------------------------------------

def test_tables_index_lengths_and_overrides():
    text = ("arg MAP = [[0, 1, 2], [2, 1, 0]]\nconst N = len(MAP), P = len(MAP[1]), X = MAP[1][0] * 10 + MAP[0][2]\n"
            "const Y = [N, 2 * P]\nmesh m (r=1)\ntensor w [X, Y[1]]\n")
    assert loads(text).tensors[0].logical_shape == (2 * 10 + 2, 2 * 3)
    layout = loads(text, args={"MAP": [[5, 0, 7], [0, 5, 1], [1, 1, 1]]})  # an override is a list (JSON's form)
    assert layout.tensors[0].logical_shape == (0 * 10 + 7, 2 * 3)
    assert dict(layout.args)["MAP"] == ((5, 0, 7), (0, 5, 1), (1, 1, 1))


@pytest.mark.parametrize("text, where, message", [
    ("const T = [1, 2]\nconst A = T[2]", "2:13", "index 2 is out of range: `T` has 2 entries"),
    ("const T = [[1], [2]]\nconst A = T[1][3]", "2:16", "index 3 is out of range: `T[1]` has 1 entries"),
    ("const T = [1, 2]\nconst A = T[0][0]", "2:16", "`T` has 1 level of lists; index 2 has nothing to index"),
    ("const T = [1, 2]\nconst A = T + 1", "2:11", "`T` is a table of 2 entries, not an integer"),
    ("const T = [[1], [2]]\nconst A = T[0] * 2", "2:11", "`T[0]` is a table of 1 entries, not an integer"),
    ("const A = 3\nconst B = len(A)", "2:15", "`len` takes a table; `A` is the integer 3"),
    ("const A = 3\nconst B = len(A + 1)", "2:15", "`len` takes a table: a name or an entry of one (`len(MAP[l])`)"),
])
def test_table_mistakes_are_diagnostics_at_the_index(text, where, message):
    with pytest.raises(LayoutError) as err:
        loads(text, "t.layout")
    first = err.value.render().splitlines()[0]
    assert first == f"t.layout:{where}: error: {message}"


def test_an_override_of_the_other_kind_is_refused():
    with pytest.raises(LayoutError, match=r"--set MAP: `MAP` is a table in the layout"):
        loads("arg MAP = [1, 2]", args={"MAP": 3})
    with pytest.raises(LayoutError, match=r"--set TP: `TP` is an integer in the layout"):
        loads("arg TP = 2", args={"TP": [2]})
    with pytest.raises(LayoutError, match=r"--set MAP: 'x' is neither an integer nor a table"):
        loads("arg MAP = [1, 2]", args={"MAP": [1, "x"]})


def test_a_table_entry_may_name_one_key_twice_but_two_part_keys_may_not():
    text = ("arg MAP = [0, 1, 0]\nmesh m (ep=3)\n"
            "tensor w [p in 0..3 over ep, (g: 2 as e.{MAP[p]}.g | u: 2 as e.{MAP[p]}.u)]")
    keys = [r.key for r in loads(text).tensors[0].regions]
    assert keys == ["e.0.g", "e.0.u", "e.1.g", "e.1.u", "e.0.g", "e.0.u"]  # slot 2 replicates expert 0
    with pytest.raises(LayoutError) as err:
        loads("mesh m (ep=3)\ntensor w [p in 0..3 over ep, (g: 2 as e.{p}.g | u: 2 as e.{p}.g)]", "d.layout")
    assert err.value.render().splitlines()[0] == "d.layout:2:57: error: key `e.0.g` is held twice by this tensor"


# ---- refits into vLLM's placements and an EPLB map -------------------------------------------------

L, E, I, H = 2, 6, 4, 8  # layers, logical experts, expert rows per part, hidden
TRAINER = f"""mesh t (ep=2)
for l in 0..{L} {{
  for e in 0..{E} over ep {{
    tensor dec.{{l}}.fc1.{{e.local}} [(gate: {I} as l.{{l}}.e.{{e}}.gate | up: {I} as l.{{l}}.e.{{e}}.up), {H}]
    tensor dec.{{l}}.fc2.{{e.local}} as l.{{l}}.e.{{e}}.down [{H}, {I}]
  }}
}}
"""


def _expert(l: int, e: int, which: str) -> torch.Tensor:
    """What the trainer holds for expert e of layer l: a formula of (layer, expert, part, row, col)."""
    rows, cols = (2 * I, H) if which == "fc1" else (H, I)
    r = torch.arange(rows, dtype=torch.float32)[:, None]
    c = torch.arange(cols, dtype=torch.float32)[None, :]
    return (l * 10_000 + e * 1000 + (0 if which == "fc1" else 500) + r * cols + c).to(torch.bfloat16)


def _trainer_tensors() -> dict[int, dict[str, torch.Tensor]]:
    per = E // 2
    return {rank: {f"dec.{l}.{which}.{j}": _expert(l, rank * per + j, which)
                   for l in range(L) for j in range(per) for which in ("fc1", "fc2")} for rank in range(2)}


def _engine(placement_dim: str, table: str = "") -> str:
    return f"""{table}mesh x (ep=3) at 2
for l in 0..{L} {{
  tensor w13.{{l}} [{placement_dim}, (gate: {I} as l.{{l}}.e.{{KEY}}.gate | up: {I} as l.{{l}}.e.{{KEY}}.up), {H}]
  tensor w2.{{l}} as l.{{l}}.e.{{KEY}}.down [{placement_dim}, {H}, {I}]
}}
"""


def _refit(dst_text: str, args=None):
    plan = compile_plan(loads(TRAINER, "trainer.layout"), loads(dst_text, "engine.layout", args))
    src = {0: {}, 1: {}, **{r: {} for r in range(2, plan.world)}}
    src.update(_trainer_tensors())
    dst = {r: {} for r in range(plan.world)}
    for t in plan.dst.tensors:
        for r in t.ranks():
            dst[r][t.name] = torch.full(t.local_shape_at(r), float("nan"), dtype=torch.bfloat16)
    loopback.refit(plan, src, dst)
    return plan, dst


def _check(dst, slots_of_rank, expert_of):
    """Slot j of engine rank c (rank 2 + c) holds logical expert expert_of(l, p), p = slots_of_rank[c][j]."""
    for c, slots in slots_of_rank.items():
        for l in range(L):
            w13, w2 = dst[2 + c][f"w13.{l}"], dst[2 + c][f"w2.{l}"]
            assert w13.shape[0] == len(slots)
            for j, p in enumerate(slots):
                e = expert_of(l, p)
                assert torch.equal(w13[j], _expert(l, e, "fc1")), (c, l, j, p, e)
                assert torch.equal(w2[j], _expert(l, e, "fc2")), (c, l, j, p, e)


def test_vllm_round_robin_and_uneven_linear_placements_refit_exactly():
    # round_robin over 3 ranks: rank c holds experts c, c+3
    _, dst = _refit(_engine(f"x in 0..{E} over ep cyclic").replace("KEY", "x"))
    _check(dst, {0: [0, 3], 1: [1, 4], 2: [2, 5]}, lambda l, p: p)
    # 5 experts over 3 ranks, vLLM's linear map: 2, 2, 1 (the engine holds the trainer's first 5 keys)
    _, dst = _refit(_engine("x in 0..5 over ep balanced").replace("KEY", "x"))
    _check(dst, {0: [0, 1], 1: [2, 3], 2: [4]}, lambda l, p: p)


def _eplb_map(seed: int, physical: int) -> list[list[int]]:
    rng = random.Random(seed)
    out = []
    for _ in range(L):
        slots = list(range(E)) + [rng.randrange(E) for _ in range(physical - E)]
        rng.shuffle(slots)
        out.append(slots)
    return out


def test_an_eplb_map_with_redundant_experts_refits_every_physical_slot():
    physical = 9  # 6 logical experts + 3 redundant copies, 3 slots per engine rank
    table = f"arg MAP = {_eplb_map(0, physical)}\nconst P = len(MAP[0])\n"
    text = _engine("p in 0..P over ep", table).replace("{KEY}", "{MAP[l][p]}")
    for seed in (0, 1, 2):  # the map in the file, then two rebalanced ones passed as args
        emap = _eplb_map(seed, physical)
        plan, dst = _refit(text, None if seed == 0 else {"MAP": emap})
        _check(dst, {0: [0, 1, 2], 1: [3, 4, 5], 2: [6, 7, 8]}, lambda l, p: emap[l][p])
        # each redundant slot is fed like any other: the plan writes every slot once
        assert sum(op.bytes for op in plan.ops) == L * physical * (2 * I * H + H * I) * 2
