"""The DTensor bridge on real FSDP2 (issue 11): describe a live `fully_shard` HF Llama,
refit it into a vLLM-style TP2 engine and back into a whole HF model on 2 gloo ranks.

Expectations come from the formats' rules applied to the unsharded model and from
torch's own DTensor gather (tests/fsdp2_refit_program.py says which), and the
logits of the model that came back equal the reference model's exactly.
"""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("transformers")

from layoutlang.runtime.launch import launch  # noqa: E402

PROGRAM = Path(__file__).with_name("fsdp2_refit_program.py")


def test_fsdp2_llama_to_vllm_tp2_and_back_twice():
    results = launch({}, 2, timeout=240, program=str(PROGRAM))
    for r in results:
        assert r.ok, f"rank {r.rank}: {r.error}\n{(r.result or {}).get('trace', '')}{r.stderr[-3000:]}"
    rank0 = results[0].result
    # FSDP2 shards every parameter's dim 0 over dp like torch.chunk: V=37 rows -> 19 and 18.
    assert "mesh dp (dp=2)" in rank0["src_text"]
    assert "tensor model.embed_tokens.weight [37 over dp ragged, 16] fp32" in rank0["src_text"]
    assert results[1].result["max_logit_diff_0"] == 0.0 and results[1].result["max_logit_diff_1"] == 0.0
    # Every engine element was compared on both ranks, both steps.
    assert rank0["checked"] > 0 and results[1].result["checked"] == rank0["checked"]


def test_tp_then_fsdp2_is_over_tp_then_chunk_dp_and_refits_whole():
    results = launch({}, 4, timeout=240, program=str(Path(__file__).with_name("dtensor_tp_fsdp_program.py")))
    for r in results:
        assert r.ok, f"rank {r.rank}: {r.error}\n{(r.result or {}).get('trace', '')}{r.stderr[-3000:]}"
    text = results[0].result["text"]
    # ColwiseParallel cuts the 7 output rows over tp (4 | 3), FSDP2 then cuts each tp block over dp
    # (_StridedShard(0, sf=2), Shard(0)): 4 -> 2 | 2 and 3 -> 2 | 1. RowwiseParallel cuts dim 1.
    assert "mesh dp_tp (dp=2, tp=2)" in text
    assert "tensor 0.weight [7 over tp ragged chunk dp ragged, 5] fp32" in text
    assert "tensor 0.bias [7 over tp ragged chunk dp ragged] fp32" in text
    assert "tensor 1.weight [3 over dp ragged, 7 over tp ragged] fp32" in text
    # rank = dp * 2 + tp: the local shapes DTensor reports, from the rule above.
    shapes = {r.rank: r.result["local_shapes"]["0.weight"] for r in results}
    assert shapes == {0: [2, 5], 1: [2, 5], 2: [2, 5], 3: [1, 5]}
    partial = results[0].result["partial"]
    assert "error: parameter `w`: placement Partial(sum) on mesh dim `dp` holds partial sums" in partial
    assert "help: reduce it" in partial
    assert "error: parameter `b` is a plain tensor among DTensors" in results[0].result["plain"]
