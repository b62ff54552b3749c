"""Rotary pairing (issue 29): what a Meta-order source needs, and what every shipped pair costs.

Meta's checkpoints and torchtitan's Llama3 keep each head's rotary pairs interleaved,
`(NH, D/2, (re: 1 | im: 1))`; HF, vLLM, SGLang and Megatron keep them split per head,
`(NH, (re: D/2 | im: D/2))`. The two name the same logical rows only when BOTH sides
write the parts (LANGUAGE.md 3: a dim with parts on one side only is an error), so the
conventions that store HF order must say so for a Meta-order source to pair without edits.

Whatever the conventions say, the ops and bytes of every shipped pair are guarded
here against the numbers main planned before this work (tests/golden/pairs/ops.json):
the `layoutc new` conventions of every family at tests/test_layoutc_new.py's sizes,
and the example groups of tests/test_example_pairs.py. The full-size groups (Llama-3-8B,
DeepSeek-V3: about 80 s of planning on a 2-core machine) run with `python
tests/test_rotary_pairing.py`, which prints and checks every pair; pytest checks the rest
(a few seconds).
"""

from __future__ import annotations

import functools
import itertools
import json
import sys
from pathlib import Path

import pytest

from layoutlang import compile_plan, load, loads
from layoutlang.bridges.families import CONVENTIONS, layout_text

sys.path.insert(0, str(Path(__file__).parent))
import test_example_pairs as pairs  # noqa: E402  (the groups of shipped examples)
import test_layoutc_new as new  # noqa: E402  (the families' configs and the sizes of their pairs)

GOLDEN = json.loads((Path(__file__).parent / "golden" / "pairs" / "ops.json").read_text())["pairs"]
FULL_SIZE = ("Llama-3-8B", "DeepSeek-V3")
EXAMPLES = Path(__file__).parent.parent / "examples"


@functools.cache
def convention_layout(family: str, convention: str):
    sizes = {k: v for k, v in new.SIZES[convention].items() if k in new._args(family, convention)}
    return loads(layout_text(new.CONFIGS[family], convention, sizes), f"{family}_{convention}")


def convention_pairs() -> list[str]:
    return [f"new:{f}:{a}->{b}" for f in new.CONFIGS for a, b in itertools.permutations(CONVENTIONS, 2)]


def example_pairs(full_size: bool) -> list[str]:
    return [f"ex:{a}->{b}" for model, names in pairs.FILES.items() if (model in FULL_SIZE) == full_size
            for a, b in itertools.permutations(names, 2)]


def planned(pair: str) -> dict[str, int]:
    kind, _, rest = pair.partition(":")
    if kind == "new":
        family, _, route = rest.partition(":")
        src, dst = (convention_layout(family, c) for c in route.split("->"))
    else:
        src, dst = (pairs.layout(name) for name in rest.split("->"))
    plan = compile_plan(src, dst)
    return {"ops": plan.stats["ops"], "bytes": plan.stats["bytes"]}


def test_the_golden_file_lists_every_shipped_pair():
    """A pair added later (a family, a convention, an example) gets its numbers recorded here."""
    assert set(GOLDEN) == set(convention_pairs() + example_pairs(False) + example_pairs(True))


@pytest.mark.timeout(120)
def test_every_convention_pair_keeps_its_ops_and_bytes():
    got = {pair: planned(pair) for pair in convention_pairs()}
    moved = {pair: (GOLDEN[pair], n) for pair, n in got.items() if n != GOLDEN[pair]}
    assert not moved, f"{len(moved)} pairs moved, first: {next(iter(moved.items()))}"


@pytest.mark.timeout(120)
def test_every_small_example_pair_keeps_its_ops_and_bytes():
    got = {pair: planned(pair) for pair in example_pairs(False)}
    moved = {pair: (GOLDEN[pair], n) for pair, n in got.items() if n != GOLDEN[pair]}
    assert not moved, f"{len(moved)} pairs moved, first: {next(iter(moved.items()))}"


def test_a_meta_order_source_pairs_only_with_rotary_parts():
    """The rule the conventions meet: the Meta file pairs with the HF file that writes the
    halves, and a plain `[NH*D, H]` q_proj is refused, naming the parts."""
    meta = load(str(EXAMPLES / "small/v2/llama2_meta.layout"))
    hf = load(str(EXAMPLES / "small/v2/llama2_hf.layout"))
    assert compile_plan(meta, hf).stats["ops"] == GOLDEN["ex:small/v2/llama2_meta->small/v2/llama2_hf"]["ops"]
    plain = (EXAMPLES / "small/v2/llama2_hf.layout").read_text().replace("[(NH, (re: D/2 | im: D/2)), H]",
                                                                       "[NH*D, H]")
    from layoutlang.compiler import PlanError

    with pytest.raises(PlanError) as e:
        compile_plan(meta, loads(plain, "plain_hf"))
    assert "parts on one side only" in e.value.message and "(re: " in e.value.message


if __name__ == "__main__":  # every pair, full-size ones included: print and check
    bad = 0
    for pair in convention_pairs() + example_pairs(False) + example_pairs(True):
        n, want = planned(pair), GOLDEN[pair]
        bad += n != want
        print(f"{'ok  ' if n == want else 'MOVED'} {pair}: {n['ops']} ops {n['bytes']} bytes"
              + ("" if n == want else f" (was {want['ops']} ops {want['bytes']} bytes)"))
    sys.exit(1 if bad else 0)
