"""Every rank's steps in one process (layoutlang/runtime/loopback.py): the Refitter's step handlers with
messages as in-process copies. Each destination is checked element by element against the
layouts (layoutlang/runtime/fill.py check_destination: the fill is a function of key and logical index,
quantized destinations must equal quantizing the expected tensor once)."""

from pathlib import Path

import pytest

from layoutlang import loads
from layoutlang.compiler import compile_plan
from layoutlang.runtime import loopback
from layoutlang.runtime.fill import check_destination, empty_destination, source_tensor

EX = Path(__file__).resolve().parent.parent / "examples"

RELAY_SRC = "mesh m (tp=2)\ntensor w [64, 64 over tp]\ntensor n [64]\n"
RELAY_DST = "mesh m (dp=6) at 2\ntensor w [64, 64] mxfp8\ntensor n [64] fp32\n"
NV_SRC = "mesh m (tp=2)\ntensor w [32 over tp, 32]\ntensor e [30, 32 over tp]\n"
NV_DST = "mesh m (r=1) at 2\ntensor w [32, 32] nvfp4\ntensor e [30 pad 32, 32] fp8_e4m3\n"


def _pair(name):
    if name == "llama-mxfp8":
        return compile_plan(EX / "small/llama_train.layout", EX / "small/llama_infer.layout")
    if name == "llama-mxfp8-bf16-wire":
        return compile_plan(EX / "small/llama_train.layout", EX / "small/llama_infer.layout", wire="bf16")
    if name == "relays-mxfp8":
        return compile_plan(loads(RELAY_SRC, "s.layout"), loads(RELAY_DST, "d.layout"))
    if name == "nvfp4-fp8-scale-agreement":
        return compile_plan(loads(NV_SRC, "s.layout"), loads(NV_DST, "d.layout"))
    if name == "llama2-meta-hf-strided":
        return compile_plan(EX / "small/v2/llama2_meta.layout", EX / "small/v2/llama2_hf.layout")
    if name == "mla-vllm-quantized-source":
        return compile_plan(EX / "small/v2/mla_vllm.layout", EX / "small/v2/mla_megatron.layout")
    raise KeyError(name)


CASES = ["llama-mxfp8", "llama-mxfp8-bf16-wire", "relays-mxfp8", "nvfp4-fp8-scale-agreement",
         "llama2-meta-hf-strided", "mla-vllm-quantized-source"]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", CASES)
@pytest.mark.parametrize("budget", [None, 4096], ids=["one-bucket", "buckets"])
def test_every_rank_in_one_process_is_exact(name, budget):
    plan = _pair(name)
    src = {r: {t.name: source_tensor(t, r) for t in plan.src.tensors if r < plan.src.ranks and t.holds(r)}
           for r in range(plan.world)}
    dst = {r: {t.name: empty_destination(t, rank=r) for t in plan.dst.tensors if r < plan.dst.ranks and t.holds(r)}
           for r in range(plan.world)}
    ranks = loopback.refit(plan, src, dst, budget_bytes=budget)
    problems = [check_destination(t, r, dst[r][t.name], plan) for r in dst for t in plan.dst.tensors
                if r < plan.dst.ranks and t.holds(r)]
    assert [p for p in problems if p] == []
    # every op moved once: the counters add up to the plan's bytes (network sent = received)
    assert sum(k.received_bytes + k.local_bytes for k in ranks.values()) == plan.stats["bytes"]
    assert sum(k.sent_bytes for k in ranks.values()) == sum(k.received_bytes for k in ranks.values())


def test_the_cases_cover_what_they_say():
    """Independent of the runtime: each named case has the feature its name promises."""
    assert any(op.wire for op in _pair("llama-mxfp8").ops)
    assert not any(op.wire for op in _pair("llama-mxfp8-bf16-wire").ops)
    assert any(op.after and op.wire for op in _pair("relays-mxfp8").ops)
    nv = _pair("nvfp4-fp8-scale-agreement")
    assert {op.wire for op in nv.ops} == {"nvfp4", "fp8_e4m3"}
    assert any(len(e) > 2 for op in _pair("llama2-meta-hf-strided").ops for e in op.src_slice + op.dst_slice)
    assert {t.dtype for t in _pair("mla-vllm-quantized-source").src.tensors} & {"mxfp8", "fp8_b128"}
