"""Random pairs across decompositions (LANGUAGE.md 8.1) checked by the slow simulator.

Each side stores the same keys k0..kn-1 (each [e_i, C]), possibly TRANSPOSED
(stored [C, e_i], LANGUAGE.md 8.3), either FUSED — one tensor
whose concatenation parts carry the keys, in any part order, optionally grouped
`(G, (...))`, split `over tp`, optionally `chunk gtp` — or SPLIT into one tensor per
key (split over tp or replicated). The plan must move every destination element
exactly once with its value (tests/plan_simulator.py values elements by key and
index in the key, from the front end's key boxes and runs, not from the plan).
"""

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from layoutlang import compile_plan, loads
from layoutlang.diagnostics import LayoutError
from plan_simulator import RunsView, check_plan_views, check_stats, simulate

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
        group = draw(st.sampled_from([1, 2]))
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


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.filter_too_much])
@given(pairs())
def test_random_decompositions_plan_exactly(pair):
    src_text, dst_text = pair
    try:
        src, dst = loads(src_text, "src.layout"), loads(dst_text, "dst.layout")
    except LayoutError:
        return  # an indivisible split: the front end's diagnostics are tested elsewhere
    plan = compile_plan(src, dst)
    report = simulate(RunsView(plan.src), RunsView(plan.dst), plan)
    check_stats(plan, report)
    check_plan_views(plan, range(plan.world))
