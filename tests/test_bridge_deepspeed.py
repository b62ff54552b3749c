"""The DeepSpeed ZeRO-3 bridge on real DeepSpeed 0.19 (issue 52): a tiny HF Llama under ZeRO-3 on 4
gloo ranks, described from `ds_shape` / `ds_tensor` / its partition group, refit into vLLM's TP2
layout (ranks 0-1) and back, saved as an HF checkpoint and loaded into a fresh ZeRO-3 model, all in ONE
launch (tests/deepspeed_zero3_program.py asserts every element there against DeepSpeed's own
`GatheredParameters`; and a tiny Qwen3-MoE's stacked experts into the HF checkpoint layout and
back). Here: the text against the flat rule written out by hand, and the saved
files against `save_pretrained` of the gathered model: the same files, index and tensor bytes.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

if not os.environ.get("LAYOUTLANG_CI"):
    pytest.importorskip("deepspeed")
    pytest.importorskip("transformers")

from safetensors import safe_open  # noqa: E402

from layoutlang.runtime.launch import launch  # noqa: E402

PROGRAM = Path(__file__).with_name("deepspeed_zero3_program.py")


def test_zero3_llama_refits_into_vllm_tp2_and_back_and_saves_and_loads(tmp_path):
    job = {"ours": str(tmp_path / "ours"), "theirs": str(tmp_path / "theirs")}
    results = launch(job, 4, timeout=240, program=str(PROGRAM))
    for r in results:
        assert r.ok, f"rank {r.rank}: {r.error}\n{(r.result or {}).get('trace', '')}{r.stderr[-3000:]}"
    reports = [r.result for r in results]
    rank0, rank1 = reports[:2]
    text = rank0["text"]
    assert all(r["text"] == text for r in reports)  # the same text on every rank
    assert "mesh zero (dp=4)" in text and "default dtype fp32" in text
    # ZeRO-3 over 4 ranks: each parameter flattened on its own, padded to a multiple of 4, cut in
    # four. model.norm.weight: 6 elements -> 8, 2 each (rank 3: padding only); the embedding
    # 37 x 6 = 222 -> 224, 56 each (rank 3: 54 + 2 padding); q_proj keeps HF's rotary halves as
    # the HF bridge writes them.
    assert "tensor model.norm.weight.ds_tensor [flat([6] as model.norm.weight) pad dp over dp]\n" in text
    assert ("tensor model.embed_tokens.weight.ds_tensor [flat([37, 6] as model.embed_tokens.weight) "
            "pad dp over dp]\n") in text
    assert ("tensor model.layers.1.self_attn.q_proj.weight.ds_tensor [flat([(2, (re: 4/2 | im: 4/2)), 6] as "
            "model.layers.1.self_attn.q_proj.weight) pad dp over dp]\n") in text
    for r in reports:
        assert r["local_numel"]["model.norm.weight.ds_tensor"] == 2
        assert r["local_numel"]["model.embed_tokens.weight.ds_tensor"] == 56
        assert r["local_numel"]["model.layers.0.mlp.down_proj.weight.ds_tensor"] == 6 * 24 // 4
    # Qwen3-MoE: transformers stacks each layer's experts (gate_up_proj [E, 2I, H], each expert's gate
    # rows then its up rows): one flat key per expert and part, in that storage order
    moe = rank0["moe_text"]
    assert all(r["moe_text"] == moe for r in reports)
    keys = " | ".join(f"[5, 6] as model.layers.0.mlp.experts.{e}.{part}_proj.weight"
                      for e in range(4) for part in ("gate", "up"))
    assert f"tensor model.layers.0.mlp.experts.gate_up_proj.ds_tensor [flat({keys}) pad dp over dp]\n" in moe
    keys = " | ".join(f"[6, 5] as model.layers.0.mlp.experts.{e}.down_proj.weight" for e in range(4))
    assert f"tensor model.layers.0.mlp.experts.down_proj.ds_tensor [flat({keys}) pad dp over dp]\n" in moe
    # a module that is no transformers model: keys are the parameter names; 0.weight's 15 elements
    # padded to 16, 4 a rank (rank 3: elements 12..14 and one padding element)
    assert all(r["plain_text"] == rank0["plain_text"] for r in reports)
    assert "layout sequential_zero3\n" in rank0["plain_text"]
    assert "tensor 0.weight.ds_tensor [flat([3, 5] as 0.weight) pad dp over dp]\n" in rank0["plain_text"]
    assert "tensor 1.bias.ds_tensor [flat([7] as 1.bias) pad dp over dp]\n" in rank0["plain_text"]
    # every engine element compared with vLLM's rule on both ranks; the step after the reverse refit ran
    assert rank0["checked"] > 0 and rank1["checked"] == rank0["checked"]
    assert rank0["step_changed"] and rank0["loss_diff"] <= 1e-6
    # checkpoint.save from the shards writes what save_pretrained of the gathered model writes: the
    # same files and index, every tensor's key, dtype, shape and bytes (the header lists them in
    # the layout's order, save_pretrained's safetensors sorts them)
    files = sorted(p.name for p in (tmp_path / "theirs").glob("*.safetensors"))
    assert len(files) > 1 and files == sorted(p.name for p in (tmp_path / "ours").glob("*.safetensors"))
    index = "model.safetensors.index.json"
    assert json.loads((tmp_path / "ours" / index).read_text()) == json.loads((tmp_path / "theirs" / index).read_text())
    for name in files:
        with safe_open(str(tmp_path / "ours" / name), "pt") as ours, \
                safe_open(str(tmp_path / "theirs" / name), "pt") as theirs:
            assert sorted(ours.keys()) == sorted(theirs.keys()), name
            for key in theirs.keys():
                assert ours.get_slice(key).get_dtype() == theirs.get_slice(key).get_dtype(), key
                want = theirs.get_tensor(key)
                got = ours.get_tensor(key)
                assert got.shape == want.shape and torch.equal(got.view(torch.uint8), want.view(torch.uint8)), key


def test_a_module_without_zero3_partitions_is_refused_naming_the_parameter():
    """ZeRO-1/2 (or no DeepSpeed) keep whole parameters: no `ds_tensor`, nothing flat to describe."""
    from layoutlang.bridges import deepspeed as ds
    from layoutlang.bridges.families import BridgeError

    module = torch.nn.Sequential(torch.nn.Linear(2, 3))
    for call in (ds.describe, ds.tensors):
        with pytest.raises(BridgeError) as err:
            call(module)
        assert "parameter `0.weight` is not partitioned by ZeRO-3 (it has no `ds_tensor`)" in str(err.value)
        assert "ZeRO stage 1 and 2 keep every parameter whole" in (err.value.help or "")
