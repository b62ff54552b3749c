"""What `Refitter.refit` says when the tensors it is given do not match the layouts (issue 49, item 5).

Two mistakes a newcomer makes first, each refused before anything moves, with the fix in the message:
fp32 master weights where the trainer layout says bf16 (declare fp32: the plan converts, which the test
then does, comparing the engine's bf16 with torch's own rounding of the masters), and an HF
`state_dict()` (checkpoint keys) where the layout wants its NAMEs (Megatron's fused QKV here, whose
parts carry the HF keys). One process, a gloo world of one.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
import torch.distributed as dist  # noqa: E402

from layoutlang import compile_plan, loads  # noqa: E402
from layoutlang.runtime import Refitter  # noqa: E402
from layoutlang.runtime.errors import RefitError  # noqa: E402

TRAIN = """layout train
mesh m (tp=1)
{dtype}
tensor decoder.layers.0.self_attention.linear_qkv.weight [(q: 4 as model.layers.0.self_attn.q_proj.weight | k: 2 as model.layers.0.self_attn.k_proj.weight | v: 2 as model.layers.0.self_attn.v_proj.weight), 8]
tensor decoder.final_layernorm.weight as model.norm.weight [8]
"""
INFER = """layout infer
mesh m (tp=1)
tensor model.layers.0.self_attn.q_proj.weight [4, 8]
tensor model.layers.0.self_attn.k_proj.weight [2, 8]
tensor model.layers.0.self_attn.v_proj.weight [2, 8]
tensor model.norm.weight [8]
"""
QKV = "decoder.layers.0.self_attention.linear_qkv.weight"
PREFIX = "rank 0: step 1, agreement: local tensors do not match the layouts, nothing was moved: rank 0: "


@pytest.fixture
def world(tmp_path):
    assert not dist.is_initialized()
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _masters() -> dict:
    g = torch.Generator().manual_seed(0)
    return {QKV: torch.randn(8, 8, generator=g), "decoder.final_layernorm.weight": torch.randn(8, generator=g)}


def _engine() -> dict:
    return {"model.layers.0.self_attn.q_proj.weight": torch.zeros(4, 8, dtype=torch.bfloat16),
            "model.layers.0.self_attn.k_proj.weight": torch.zeros(2, 8, dtype=torch.bfloat16),
            "model.layers.0.self_attn.v_proj.weight": torch.zeros(2, 8, dtype=torch.bfloat16),
            "model.norm.weight": torch.zeros(8, dtype=torch.bfloat16)}


def _refused(plan, src, dst) -> str:
    with pytest.raises(RefitError) as info:
        Refitter(plan, timeout=30).refit(src, dst)
    return info.value.message


def test_fp32_masters_where_the_layout_says_bf16_are_told_to_declare_fp32(world):
    plan = compile_plan(loads(TRAIN.format(dtype=""), "train.layout"), loads(INFER, "infer.layout"))
    masters, engine = _masters(), _engine()
    message = _refused(plan, masters, engine)
    assert message == PREFIX + (
        f"source tensor `{QKV}`: expected [8, 8] torch.bfloat16, got [8, 8] torch.float32; "
        "source tensor `decoder.final_layernorm.weight`: expected [8] torch.bfloat16, got [8] "
        "torch.float32; "
        f"hint: the source tensors are fp32 where the source layout says bf16 (`{QKV}`, declared at "
        "train.layout:4): declare `fp32` in the source layout (`default dtype fp32` before its tensors, or "
        "`fp32` after a tensor's dims) and keep passing them as they are: the plan converts between the two "
        "sides' dtypes")
    assert all(not t.any() for t in engine.values())   # nothing moved
    # as the hint says: the masters as they are, the engine in bf16, torch's rounding of them
    plan = compile_plan(loads(TRAIN.format(dtype="default dtype fp32"), "train.layout"), loads(INFER, "infer.layout"))
    Refitter(plan, timeout=30).refit(masters, engine)
    bf16 = masters[QKV].to(torch.bfloat16)
    assert torch.equal(engine["model.layers.0.self_attn.q_proj.weight"], bf16[:4])
    assert torch.equal(engine["model.layers.0.self_attn.v_proj.weight"], bf16[6:])
    assert torch.equal(engine["model.norm.weight"], masters["decoder.final_layernorm.weight"].to(torch.bfloat16))


@pytest.mark.parametrize("first,owner", [("model.layers.0.self_attn.q_proj.weight", f"a part of `{QKV}`"),
                                         ("model.norm.weight", "`decoder.final_layernorm.weight`")])
def test_an_hf_state_dict_is_told_its_keys_are_not_the_layouts_names(world, first, owner):
    """The hint names the first given key that is a layout key, and the NAME that holds it."""
    plan = compile_plan(loads(TRAIN.format(dtype=""), "train.layout"), loads(INFER, "infer.layout"))
    hf = {k: v for k, v in sorted(_engine().items(), key=lambda kv: kv[0] != first)}
    hf = {"lm_head.weight": torch.zeros(3), **hf}            # a key no layout names comes first
    message = _refused(plan, hf, _engine())
    assert message == PREFIX + (
        f"source tensor `{QKV}` is missing; source tensor `decoder.final_layernorm.weight` is missing; "
        "hint: the source tensors are keyed by checkpoint keys where the layout wants its NAMEs: "
        f"`{first}` is the key of {owner}; pass each tensor under the NAME its `tensor` statement declares (the "
        "rank's own state-dict names, e.g. layoutlang.bridges.megatron.tensors(model) or named_parameters())")
