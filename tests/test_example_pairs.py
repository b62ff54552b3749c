"""Any two shipped layouts of one model pair without edits, in both directions (issue 10).

Every shipped example follows the HF-key convention (LANGUAGE.md 8): a key is the HF
checkpoint name of the unfused, per-expert weight, whatever the framework calls the
stored tensor (Megatron's grouped `linear_qkv` carries the part keys q_proj | k_proj |
v_proj, vLLM's `qkv_proj` the same three). So two layouts of the same model must plan
against each other as shipped: no `as` mapping per pair, no `--set`.

"The same model" is the same set of (key, logical shape of the key), i.e. the same
weights. GROUPS names each model's files as the issue does (`llama3_8b_*` with
`v2/llama3_8b_*`, ...), so a layout added later to a family joins its pairs; every
group is checked to be one model (a conversion slip that renames one key or changes a
shape fails there, not quietly in a pair) and to hold at least the files named in
MEMBERS. The small MoE files are two models, not one: small/moe_* is a DeepSeek-V3
miniature (layer 0 dense, attention, shared experts), small/v2/moe_* an expert block
alone (every layer MoE, no attention); they share only some key names.

- CPU-size groups (examples/small/): each ordered pair is executed element by element
  by tests/plan_simulator.py (values by key and index in the key, from the layouts'
  runs): every destination data element written exactly once with its own value,
  padding never written, every op's slices and bytes right.
- Full-size groups (Llama-3-8B, DeepSeek-V3): each ordered pair is planned once (the
  compiler's proof runs); the plan has no unused key, its statistics agree with its
  ops, and every destination rank receives exactly the data bytes its layout holds
  (elements from the destination's runs, times the wire size of its dtype).
Both kinds check the received bytes against the destination layout, not against the
code under test.
"""

from __future__ import annotations

import functools
import itertools
import math
from pathlib import Path

import pytest

import layoutlang
from layoutlang.compiler import compile_plan
from plan_simulator import RunsView, check_plan_views, check_stats, simulate
from wire_rule import op_wire, slice_elements

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"

# Each model's files, by pattern under examples/ (the families of issue 10).
GROUPS = {
    "Llama-3-8B": ["llama3_8b_*", "v2/llama3_8b_*"],
    "DeepSeek-V3": ["deepseek_v3_*", "v2/deepseek_v3_*"],
    "small Llama": ["small/llama_*", "small/v2/llama_*"],
    "small DeepSeek-V3": ["small/moe_*"],
    "small expert block": ["small/v2/moe_*"],
    "small uneven-PP Llama": ["small/pp_*"],
    "small Nemotron-H": ["small/mamba_*"],
    "Llama-2-13B": ["v2/llama2_13b_*"],
    "small Llama-2": ["small/v2/llama2_*"],
}
# By hand: the files each group holds at least (a pattern that matches less is a mistake).
MEMBERS = {
    "Llama-3-8B": {"llama3_8b_train", "llama3_8b_infer", "llama3_8b_infer_offset", "llama3_8b_infer_tp16",
                   "v2/llama3_8b_megatron", "v2/llama3_8b_vllm"},
    "DeepSeek-V3": {"deepseek_v3_moe", "deepseek_v3_infer", "v2/deepseek_v3_infer_stacked"},
    "small Llama": {"small/llama_train", "small/llama_infer", "small/llama_infer_tp4",
                    "small/v2/llama_hf", "small/v2/llama_megatron", "small/v2/llama_vllm"},
    "small DeepSeek-V3": {"small/moe_train", "small/moe_infer"},
    "small expert block": {"small/v2/moe_hf", "small/v2/moe_megatron", "small/v2/moe_vllm"},
    "small uneven-PP Llama": {"small/pp_train", "small/pp_infer"},
    "small Nemotron-H": {"small/mamba_train", "small/mamba_infer"},
    "Llama-2-13B": {"v2/llama2_13b_meta", "v2/llama2_13b_hf"},  # interleaved vs split rotary rows
    "small Llama-2": {"small/v2/llama2_meta", "small/v2/llama2_hf"},
}


def _files(patterns: list[str]) -> list[str]:
    return sorted({p.relative_to(EXAMPLES).with_suffix("").as_posix()
                   for pattern in patterns for p in EXAMPLES.glob(f"{pattern}.layout")})


FILES = {model: _files(patterns) for model, patterns in GROUPS.items()}

@pytest.fixture(scope="module", autouse=True)
def _one_torch_thread():
    """The simulator's tensors are small: torch's intra-op threads only contend for the CPU
    (one small pair: 1.6 s with 2 threads, 0.09 s with 1, on the 2-core machine)."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@functools.cache
def layout(name: str) -> layoutlang.Layout:
    return layoutlang.load(EXAMPLES / f"{name}.layout")


def signature(name: str) -> frozenset:
    """The model a layout describes: its keys with their logical shapes."""
    return frozenset((key, region.key_shape if region is not None else t.logical_shape)
                     for key, ((t, region), *_) in layout(name).key_index.items())


def _pairs(small: bool) -> list:
    out = []
    for model, names in FILES.items():
        if names[0].startswith("small/") != small:
            continue
        for src, dst in itertools.permutations(names, 2):
            out.append(pytest.param(src, dst, id=f"{src}->{dst}"))
    return out


def _group_params() -> list:
    return [pytest.param(model, id=model) for model in FILES]


@pytest.mark.parametrize("model", _group_params())
def test_each_group_is_one_model(model):
    """A group's files describe one model: the same keys, the same shapes; and it holds the
    files MEMBERS names."""
    names = FILES[model]
    assert MEMBERS[model] <= set(names), sorted(MEMBERS[model] - set(names))
    first = signature(names[0])
    for name in names[1:]:
        other = signature(name)
        assert other == first, (f"{name} and {names[0]} differ in keys: only in {name}: "
                                f"{sorted(other - first)[:3]}, only in {names[0]}: {sorted(first - other)[:3]}")


def test_different_models_stay_apart():
    """No file is in two groups, and no two groups describe the same model (the small
    DeepSeek-V3 and the expert block share layer 1's router and expert key names only)."""
    placed = [name for names in FILES.values() for name in names]
    assert len(placed) == len(set(placed))
    assert len({signature(sorted(MEMBERS[model])[0]) for model in GROUPS}) == len(GROUPS)


@functools.cache
def received_elements(name: str) -> dict[int, int]:
    """Per destination rank, from the layout alone: its data elements."""
    out: dict[int, int] = {}
    for t in layout(name).tensors:
        for rank in t.ranks():
            data = math.prod(sum(r.length for r in runs if isinstance(r, layoutlang.Run)) for runs in t.runs(rank))
            out[rank] = out.get(rank, 0) + data
    return out


def _check_totals(plan, dst: str) -> None:
    """Every destination rank receives its data elements; every op's bytes follow the wire rule."""
    assert plan.unused_keys == []
    got: dict[int, int] = {}
    held = {t.name: t for t in plan.dst.tensors}
    for op in plan.ops:
        got[op.dst_rank] = got.get(op.dst_rank, 0) + slice_elements(op.dst_slice)
        t = held[op.dst_name]
        assert (op.wire is not None, op.bytes) == op_wire(op.dst_slice, t.dtype, tuple(t.local_shape_at(op.dst_rank)))
    assert got == received_elements(dst)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("src,dst", _pairs(small=True))
def test_small_pair_moves_every_element_once(src, dst):
    plan = compile_plan(layout(src), layout(dst))
    report = simulate(RunsView(plan.src), RunsView(plan.dst), plan)
    assert report.elements == report.dst_data_elements
    check_stats(plan, report)
    check_plan_views(plan, range(plan.world))
    _check_totals(plan, dst)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("src,dst", _pairs(small=False))
def test_full_size_pair_plans(src, dst):
    plan = compile_plan(layout(src), layout(dst))
    check_stats(plan)
    _check_totals(plan, dst)
