"""Random pairs across decompositions (LANGUAGE.md 8) checked by the slow simulator.

Part keys (8.1): each side stores the same keys k0..kn-1 (each [e_i, C]), possibly
TRANSPOSED (stored [C, e_i], 8.3), either FUSED — one tensor whose concatenation
parts carry the keys, in any part order, optionally grouped `(G, (...))`, split
`over tp`, optionally `chunk gtp` — or SPLIT into one tensor per key (split over
tp or replicated). Values come from the front end's key boxes and runs
(plan_simulator.RunsView).

Stacked dims (8.2): the same keys per expert (one or two stack variables); each
side stacks each variable into a dim (anywhere among the dims, `over`/`chunk`/
`align` on it) or loops over it with per-expert tensors, with the part and
transposed forms above. Here the test writes down its own model of every
instance and the simulator runs on it (plan_simulator.ModelView): the front
end must agree with the model, and nothing the simulator checks comes from it.

Either way the plan must move every destination element exactly once with its
value (values by key and index in the key), never from the plan itself.
"""

import dataclasses
import itertools
import os
import types
from dataclasses import dataclass

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from layoutlang import compile_plan, loads
from layoutlang.diagnostics import LayoutError
from plan_simulator import (ModelInstance, ModelRegion, ModelView, RunsView, check_plan_views, check_stats,
                            simulate)
from reference_enumerator import Concat, Dim, MeshSpec, Mode, Plain, Product, dim_is_valid


C = 4


@st.composite
def sides(draw, extents: list[int], offset_max: int):
    n = len(extents)
    tp = draw(st.sampled_from([1, 2, 4]))
    dp = draw(st.sampled_from([1, 2]))
    gtp = draw(st.sampled_from([1, 2]))
    at = draw(st.integers(0, offset_max))
    mesh = f"mesh m (dp={dp}, gtp={gtp}, tp={tp}) at {at}"
    dtype = draw(st.sampled_from(["", " fp32", " fp16"]))
    turned = draw(st.booleans())  # stored [C, e] transposed (LANGUAGE.md 8.3) for keys [e, C]

    def dims(first: str) -> str:
        return f"[{C}, {first}]" if turned else f"[{first}, {C}]"

    t = " transposed" if turned else ""
    if draw(st.booleans()):  # fused, parts carry keys
        order = draw(st.permutations(range(n)))
        group = draw(st.sampled_from([1, 2, 4, 8, 8]))  # 4, 8 groups: a key's rows are strided blocks
        if any(extents[i] % group for i in order):
            group = 1
        parts = " | ".join(f"p{i}: {extents[i] // group} as k{i}" for i in order)
        mode = f"({parts})" if group == 1 else f"({group}, ({parts}))"
        split = draw(st.sampled_from(["", " over tp", " over tp chunk gtp"]))
        body = f"tensor fused {dims(mode + split)}{dtype}{t}"
    else:  # one tensor per key
        lines = []
        for i in range(n):
            split = draw(st.sampled_from(["", " over tp"]))
            lines.append(f"tensor t{i} as k{i} {dims(str(extents[i]) + split)}{dtype}{t}")
        body = "\n".join(lines)
    return f"{mesh}\n{body}\n"


@st.composite
def pairs(draw):
    n = draw(st.integers(1, 3))
    extents = [draw(st.sampled_from([8, 16, 24])) for _ in range(n)]
    return draw(sides(extents, 0)), draw(sides(extents, 8))


@settings(max_examples=int(os.environ.get("PLAN_EXAMPLES", 120)),  # more: PLAN_EXAMPLES=N
          deadline=None, suppress_health_check=[HealthCheck.filter_too_much])
@given(pairs())
def test_random_decompositions_plan_exactly(pair):
    src_text, dst_text = pair
    try:
        src, dst = loads(src_text, "src.layout"), loads(dst_text, "dst.layout")
    except LayoutError:
        return  # an indivisible split: the front end's diagnostics are tested elsewhere
    plan = compile_plan(src, dst)
    if any(len(e) > 2 for op in plan.ops for e in op.src_slice + op.dst_slice):
        event("strided ops")
    report = simulate(RunsView(plan.src), RunsView(plan.dst), plan)
    check_stats(plan, report)
    check_plan_views(plan, range(plan.world))


# ---------------------------------------------------------------------------
# Stacked dims (LANGUAGE.md 8.2) against per-expert layouts and other stackings.
#
# Keys x.{a}.k{i} (one stack variable) or x.{a}.{b}.k{i} (two), each [e_i, C]. Per side
# and per variable: a STACKED dim `a in S..S+A [over X] [chunk Y [align K]]` at any
# position among the dims, or a `for a in S..S+A [over X]` loop of per-expert tensors
# (keys `{a - S}`: any offset names the same experts). The parts are fused (part keys,
# any order, grouped or not, over/chunk) or split, the side stored transposed or not,
# C split or not, on a random mesh (dp, ep, fp, tp) at a random offset. The test
# writes down its own model of every instance (names, holders, reference `Dim`s, key
# boxes) from these choices; the front end must agree with it, and the plan is run
# by the simulator on the MODEL's maps (plan_simulator.ModelView).

MESH_AXES = ("dp", "ep", "fp", "tp")


@dataclass(frozen=True)
class Split:
    over: str | None = None
    chunk: str | None = None
    align: int | None = None

    def text(self) -> str:
        out = f" over {self.over}" if self.over else ""
        if self.chunk:
            out += f" chunk {self.chunk}" + (f" align {self.align}" if self.align is not None else "")
        return out

    def axes(self) -> set[str]:
        return {a for a in (self.over, self.chunk) if a}

    def dim(self, mode: Mode) -> Dim:
        return Dim(mode, (self.over,) if self.over else (), self.chunk, self.align if self.chunk else None)


@dataclass(frozen=True)
class VarForm:
    """How one side stores a stack variable: a stacked dim (inserted at `position` among the
    dims built so far) or a `for` loop (nested in the order of the forms; `split.over` only)."""

    var: str
    extent: int
    offset: int
    stacked: bool
    split: Split
    position: int = 0


@dataclass(frozen=True)
class SideChoice:
    sizes: tuple[tuple[str, int], ...]
    at: int
    forms: tuple[VarForm, ...]
    fused: bool
    order: tuple[int, ...]            # fused: the parts in written order
    group: int                        # fused: `(G, (...))`
    part_splits: tuple[Split, ...]    # fused: one; split: one per key part
    c_split: Split
    turned: bool
    dtype: str


@dataclass(frozen=True)
class Side:
    text: str
    model: tuple[ModelInstance, ...]
    valid: bool                       # every split legal per reference_enumerator
    kind: str                         # for hypothesis' statistics: which forms it uses

    def __repr__(self) -> str:
        return f"Side(valid={self.valid}, text=\n{self.text})"


def build_side(c: SideChoice, extents: tuple[int, ...]) -> Side:
    """The `.layout` text of `c` and the model of every instance it declares, from the rules:
    a stacked dim is a plain extent whose index j holds the key with the variable at S + j
    (box [j, j + 1)); parts hoist to written order (a part key's box is its offset among the
    parts as written, whatever the group); a transposed side stores [C, e] for keys [e, C]."""
    mesh = MeshSpec("m", c.sizes, c.at)
    n = len(extents)
    by_var = sorted(c.forms, key=lambda f: f.var)

    def key_text(i: int) -> str:
        return "x" + "".join(f".{{{f.var}{f' - {f.offset}' if f.offset else ''}}}" for f in by_var) + f".k{i}"

    def key_of(index: dict[str, int], i: int) -> str:
        return "x" + "".join(f".{index[f.var]}" for f in by_var) + f".k{i}"

    stacked = [f for f in c.forms if f.stacked]
    loops = [f for f in c.forms if not f.stacked]
    suffix = "".join(f".{{{f.var}}}" for f in loops)
    t = " transposed" if c.turned else ""
    tensors = []  # (name stem, parts it holds, text of its dims, Dims, stored position of each dim's role)
    for j, parts in enumerate([c.order] if c.fused else [(i,) for i in range(n)]):
        split = c.part_splits[j]
        if c.fused:
            inner = " | ".join(f"p{i}: {extents[i] // c.group} as {key_text(i)}" for i in parts)
            mode_text = f"({inner})" if c.group == 1 else f"({c.group}, ({inner}))"
            concat = Concat(tuple((f"p{i}", Plain(extents[i] // c.group)) for i in parts))
            mode = concat if c.group == 1 else Product(c.group, concat)
        else:
            mode_text, mode = str(extents[parts[0]]), Plain(extents[parts[0]])
        dims = [("part", mode_text + split.text(), split.dim(mode)),
                ("c", f"{C}{c.c_split.text()}", c.c_split.dim(Plain(C)))]
        if c.turned:
            dims.reverse()
        for f in stacked:
            dims.insert(min(f.position, len(dims)),
                        (f.var, f"{f.var} in {f.offset}..{f.offset + f.extent}{f.split.text()}",
                         f.split.dim(Plain(f.extent))))
        name = "fused" if c.fused else f"t{parts[0]}"
        alias = "" if c.fused else f" as {key_text(parts[0])}"
        line = f"tensor {name}{suffix}{alias} [{', '.join(d[1] for d in dims)}]{c.dtype}{t}"
        tensors.append((name, parts, line, dims))

    body = [line for _, _, line, _ in tensors]
    for depth, f in reversed(list(enumerate(loops))):
        pad = "  " * depth
        body = [f"{pad}for {f.var} in {f.offset}..{f.offset + f.extent}{f.split.text()} {{",
                *("  " + b for b in body), f"{pad}}}"]
    mesh_line = f"mesh m ({', '.join(f'{a}={k}' for a, k in c.sizes)}) at {c.at}"
    text = "\n".join([mesh_line, *body]) + "\n"

    valid = all(dim_is_valid(d[2], mesh.sizes) for _, _, _, dims in tensors for d in dims)
    model = []
    for iteration in itertools.product(*(range(f.extent) for f in loops)):
        index = dict(zip((f.var for f in loops), iteration))
        holders = []
        for rank in range(c.at, c.at + mesh.size):
            coords = mesh.coords(rank)
            # `for v over X`: iteration i on coordinate i // (V / size(X)), contiguous blocks
            if all(coords[f.split.over] == index[f.var] // (f.extent // mesh.sizes[f.split.over])
                   for f in loops if f.split.over):
                holders.append(rank)
        for stem, parts, _, dims in tensors:
            name = stem + "".join(f".{f.offset + index[f.var]}" for f in loops)
            ref_dims = tuple(d[2] for d in dims)
            if not stacked and not c.fused and not c.turned:  # a v1 tensor: one key
                model.append(ModelInstance(name, key_of(index, parts[0]), mesh, ref_dims, tuple(holders), None))
                continue
            offsets = dict(zip(parts, itertools.accumulate([extents[i] for i in parts], initial=0)))
            regions = []
            for stack_index in itertools.product(*(range(f.extent) for f in stacked)):
                full = {**index, **dict(zip((f.var for f in stacked), stack_index))}
                for i in parts:
                    box = []
                    for role, _, _ in dims:
                        if role == "part":
                            box.append((offsets[i], offsets[i] + extents[i]))
                        elif role == "c":
                            box.append((0, C))
                        else:
                            box.append((full[role], full[role] + 1))
                    stacked_dims = tuple(p for p, (role, _, _) in enumerate(dims) if role not in ("part", "c"))
                    regions.append(ModelRegion(key_of(full, i), tuple(box), stacked_dims, c.turned))
            model.append(ModelInstance(name, name, mesh, ref_dims, tuple(holders), tuple(regions)))
    kind = ", ".join([f"{len(stacked)} stacked", f"{len(loops)} loops", "fused" if c.fused else "split"]
                     + (["transposed"] if c.turned else []))
    return Side(text, tuple(model), valid, kind)


@st.composite
def side_choices(draw, variables: tuple[tuple[str, int], ...], n: int, extents: tuple[int, ...], offset_max: int):
    sizes, world = [], 1
    for a in MESH_AXES:
        k = draw(st.sampled_from([s for s in ((1, 2, 4) if a == "ep" else (1, 2)) if world * s <= 16]))
        sizes.append((a, k))
        world *= k
    size = dict(sizes)
    at = draw(st.integers(0, offset_max))
    free = list(MESH_AXES)

    def axis(fits=lambda k: True, used=()) -> str | None:
        options = [a for a in free if a not in used and fits(size[a])]
        if not options or not draw(st.booleans()):
            return None
        return draw(st.sampled_from(options))

    def chunk_of(local: int, used: set[str]) -> Split:
        y = axis(used=used)
        if y is None:
            return Split()
        align = draw(st.sampled_from([None, 1, 2] if local % size[y] == 0 else [1, 2, 1, None]))
        return Split(chunk=y, align=align)

    forms = []
    for var, extent in draw(st.permutations(variables)):
        offset = draw(st.sampled_from([0, 0, 2]))
        if draw(st.booleans()):  # a per-expert loop
            x = axis(lambda k, extent=extent: extent % k == 0)
            if x:
                free.remove(x)  # every tensor in the loop uses it
            forms.append(VarForm(var, extent, offset, False, Split(over=x)))
            continue
        forms.append(VarForm(var, extent, offset, True, Split(), draw(st.integers(0, 3))))
    # the stacked dims' splits, shared by every tensor of the side (each axis once per tensor)
    used: set[str] = set()
    done = []
    for f in forms:
        if f.stacked:
            x = axis(lambda k, f=f: f.extent % k == 0, used)
            split = Split(over=x)
            used |= split.axes()
            if draw(st.booleans()):
                more = chunk_of(f.extent // (size[x] if x else 1), used)
                split = Split(x, more.chunk, more.align)
                used |= split.axes()
            f = VarForm(f.var, f.extent, f.offset, True, split, f.position)
        done.append(f)
    c_over = axis(lambda k: C % k == 0, used)
    used |= {c_over} if c_over else set()
    fused = n > 1 and draw(st.booleans())
    order = tuple(draw(st.permutations(range(n)))) if fused else tuple(range(n))
    group = draw(st.sampled_from([1, 2])) if fused and all(e % 2 == 0 for e in extents) else 1
    part_splits = []
    for _ in range(1 if fused else n):
        x = axis(used=used)
        split = Split(over=x)
        if fused and draw(st.booleans()):
            more = chunk_of(sum(extents) // (size[x] if x else 1), used | split.axes())
            split = Split(x, more.chunk, more.align)
        part_splits.append(split)
    return SideChoice(tuple(sizes), at, tuple(done), fused, order, group, tuple(part_splits), Split(over=c_over),
                      draw(st.booleans()), draw(st.sampled_from(["", " fp32", " fp16"])))


@st.composite
def stacked_pairs(draw):
    variables = (("a", draw(st.sampled_from([2, 4]))),)
    if draw(st.booleans()):
        variables += (("b", draw(st.sampled_from([1, 2, 3]))),)
    n = draw(st.integers(1, 3))
    extents = tuple(draw(st.sampled_from([4, 8])) for _ in range(n))
    src = build_side(draw(side_choices(variables, n, extents, 0)), extents)
    dst = build_side(draw(side_choices(variables, n, extents, 8)), extents)
    return src, dst


def _front_end_agrees(layout, side: Side) -> None:
    """Instances, holders and key boxes of the front end equal the side's model."""
    model = {m.name: m for m in side.model}
    assert sorted(t.name for t in layout.tensors) == sorted(model)
    for t in layout.tensors:
        m = model[t.name]
        assert sorted(t.ranks()) == sorted(m.holders), t.name
        if m.regions is None:
            assert t.regions is None and t.key == m.key, t.name
        else:
            got = {(r.key, r.box, r.stacked, r.transposed) for r in t.regions}
            assert got == {(r.key, r.box, r.stacked, r.transposed) for r in m.regions}, t.name


def _check_stacked_pair(src: Side, dst: Side, note=lambda what: None) -> None:
    layouts = []
    for side, path in ((src, "src.layout"), (dst, "dst.layout")):
        if not side.valid:  # an indivisible split: the front end must say so too
            note("an indivisible split")
            with pytest.raises(LayoutError):
                loads(side.text, path)
            return
        layouts.append(loads(side.text, path))
    for layout, side in zip(layouts, (src, dst)):
        _front_end_agrees(layout, side)
    for side, name in ((src, "src"), (dst, "dst")):
        note(f"{name}: {side.kind}")
    plan = compile_plan(*layouts)
    report = simulate(ModelView(layouts[0], src.model), ModelView(layouts[1], dst.model), plan)
    check_stats(plan, report)
    check_plan_views(plan, range(plan.world))
    assert report.dst_data_elements > 0


def _choice(sizes, forms, *, fused=False, order=(0,), group=1, parts=(Split(),), c=Split(), turned=False, at=0):
    return SideChoice(tuple(sizes.items()), at, tuple(forms), fused, order, group, tuple(parts), c, turned, "")


# hand-picked pairs: each named case must be reached on every run, whatever hypothesis draws
PER_EXPERT_LOOP = _choice({"dp": 1, "ep": 2, "fp": 1, "tp": 2},
                          [VarForm("a", 4, 0, False, Split(over="ep"))], parts=(Split(over="tp"), Split(over="tp")))
STACKED_OVER_CHUNK_FUSED = _choice({"dp": 2, "ep": 2, "fp": 2, "tp": 1},
                                   [VarForm("a", 4, 2, True, Split(over="ep", chunk="fp"), 0)],
                                   fused=True, order=(1, 0), group=2, at=4)
STACKED_TRANSPOSED_ALIGN = _choice({"dp": 1, "ep": 4, "fp": 1, "tp": 2},
                                   [VarForm("a", 4, 0, True, Split(chunk="tp", align=4), 1)],
                                   parts=(Split(over="ep"), Split()), turned=True, at=3)
TWO_STACKS = _choice({"dp": 1, "ep": 2, "fp": 2, "tp": 1},
                     [VarForm("b", 2, 0, True, Split(over="fp"), 0), VarForm("a", 4, 0, True, Split(over="ep"), 2)],
                     fused=True, order=(0, 1))
TWO_STACKS_OTHER_WAY = _choice({"dp": 1, "ep": 2, "fp": 2, "tp": 2},
                               [VarForm("a", 4, 2, True, Split(over="fp", chunk="ep"), 0),
                                VarForm("b", 2, 0, False, Split(over="tp"))],
                               parts=(Split(), Split()), turned=True, at=2)
TWO_LOOPS = _choice({"dp": 2, "ep": 2, "fp": 1, "tp": 1},
                    [VarForm("b", 2, 1, False, Split()), VarForm("a", 4, 0, False, Split(over="ep"))],
                    parts=(Split(), Split()), at=8)
EXTENTS = (8, 4)


def _pair(src: SideChoice, dst: SideChoice) -> tuple[Side, Side]:
    return build_side(src, EXTENTS), build_side(dst, EXTENTS)


@pytest.mark.parametrize("src,dst", [
    (STACKED_OVER_CHUNK_FUSED, PER_EXPERT_LOOP),
    (PER_EXPERT_LOOP, STACKED_TRANSPOSED_ALIGN),
    (STACKED_OVER_CHUNK_FUSED, STACKED_TRANSPOSED_ALIGN),
    (TWO_STACKS, TWO_LOOPS),
    (TWO_LOOPS, TWO_STACKS_OTHER_WAY),
    (TWO_STACKS, TWO_STACKS_OTHER_WAY),
], ids=["stacked-over-chunk-fused->per-expert", "per-expert->stacked-transposed-align",
        "stacked->restacked-transposed", "two-stacks->two-loops", "two-loops->stacked-and-loop-transposed",
        "two-stacks->other-stack-order"])
def test_named_stacked_pairs_plan_exactly(src, dst):
    s, d = build_side(src, EXTENTS), build_side(dst, EXTENTS)
    assert s.valid and d.valid, (s, d)
    _check_stacked_pair(s, d)


def test_the_model_writes_a_stacked_side_as_the_spec_does():
    """The builder's text and boxes for one side, by hand: experts a = 2..5 over ep chunk fp as
    stored index 0..3, parts written k1 then k0 (k1's box first), grouped by 2."""
    side = build_side(STACKED_OVER_CHUNK_FUSED, EXTENTS)
    assert side.text == ("mesh m (dp=2, ep=2, fp=2, tp=1) at 4\n"
                         "tensor fused [a in 2..6 over ep chunk fp, (2, (p1: 2 as x.{a - 2}.k1 | p0: 4 as x.{a - 2}.k0)),"
                         " 4]\n")
    (inst,) = side.model
    assert inst.holders == tuple(range(4, 12))
    assert ModelRegion("x.3.k0", ((3, 4), (4, 12), (0, 4)), (0,)) in inst.regions
    assert ModelRegion("x.0.k1", ((0, 1), (0, 4), (0, 4)), (0,)) in inst.regions
    assert len(inst.regions) == 8


@settings(max_examples=int(os.environ.get("PLAN_EXAMPLES", 150)),  # more: PLAN_EXAMPLES=N
          deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(stacked_pairs())
def test_random_stacked_decompositions_plan_exactly(pair):
    _check_stacked_pair(*pair, note=event)


def test_the_simulator_catches_an_expert_landing_at_the_wrong_stacked_index():
    """The model view makes a misplaced stacked op visible: move every op into local expert slot 0
    of the destination's stacked dim (dim 1: [C, a, part]) to slot 1 and the simulation must fail."""
    src, dst = _pair(PER_EXPERT_LOOP, STACKED_TRANSPOSED_ALIGN)
    layouts = loads(src.text, "src.layout"), loads(dst.text, "dst.layout")
    plan = compile_plan(*layouts)
    views = ModelView(layouts[0], src.model), ModelView(layouts[1], dst.model)
    simulate(*views, plan)
    moved = [dataclasses.replace(op, dst_slice=(op.dst_slice[0], (1, 2), op.dst_slice[2]))
             if op.dst_slice[1] == (0, 1) else op for op in plan.ops]
    assert moved != list(plan.ops)
    with pytest.raises(AssertionError, match="(wrong value|more than once|never written).*"):
        simulate(*views, types.SimpleNamespace(ops=moved))
