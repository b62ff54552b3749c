"""The DeepSpeed ZeRO-3 bridge on real DeepSpeed 0.19 (issue 52): a tiny HF Llama under ZeRO-3 on 4
gloo ranks, described from `ds_shape` / `ds_tensor` / its partition group, refit into vLLM's TP2
layout (ranks 0-1) and back, saved as an HF checkpoint and loaded into a fresh ZeRO-3 model, all in ONE
launch (tests/deepspeed_zero3_program.py asserts every element there against DeepSpeed's own
`GatheredParameters`; and a tiny Qwen3-MoE's stacked experts into the HF checkpoint layout and
back). Beside it, a vLLM TP2 engine as a job of its own: 2 more processes of the launch, in a torch
world of their own (tests/zero3_engine_program.py; the trainer refits it with a `TrainerJob` from
the `ds_tensor`s, the engine job refits the trainer's `ds_tensor`s back with a `TrainerJob` of its
own: docs/jobs.md), for the Llama and the MoE; and the same with a 2-rank ZeRO-3 world. Here: the text against the flat rule written out by hand,
and the saved files against `save_pretrained` of the gathered model: the same files, index and
tensor bytes.

(DeepSpeed cannot partition over a sub-group of a larger torch world: its ZeRO-3 optimizer meets
the whole world at `dist.barrier()` while it sets up, stage3.py `_setup_for_real_optimizer`; so the
engine is a job of its own, as disaggregated RL runs vLLM.)
"""

from __future__ import annotations

import json
import os
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

if not os.environ.get("LAYOUTLANG_CI"):
    pytest.importorskip("deepspeed")
    pytest.importorskip("transformers")

from safetensors import safe_open  # noqa: E402

from layoutlang.runtime.launch import free_port, launch  # noqa: E402

PROGRAM = Path(__file__).with_name("deepspeed_zero3_program.py")


def _run(tmp_path: Path, world: int, **job) -> tuple[list[dict], list[dict]]:
    """The ZeRO-3 trainer's job of `world` ranks and the engine job's of 2 (one launch, two worlds):
    each one's reports, after every rank of both said ok."""
    # the jobs' store, up before either job starts (the launcher hosts it: no job waits to reach it)
    store = dist.TCPStore("127.0.0.1", 0, None, True, timedelta(seconds=240), wait_for_workers=False)
    job.update(world=world, dir=str(tmp_path), store=store.port, ports={"trainer": free_port(), "engine": free_port()})
    results = launch(job, world + 2, timeout=240, program=str(PROGRAM))  # each job joins its own world
    del store
    failed = [(f"trainer rank {r.rank}" if i < world else f"engine rank {r.rank}", r)
              for i, r in enumerate(results) if not r.ok]
    # every failing rank's first line (the first is often a peer's "Connection reset"), then the first's detail
    assert not failed, "\n".join([f"{who}: {str(r.error).splitlines()[0] if r.error else r.returncode}"
                                  for who, r in failed] + [f"{(failed[0][1].result or {}).get('trace', '')}"
                                                           f"{failed[0][1].stderr[-3000:]}"])
    return [r.result for r in results[:world]], [r.result for r in results[world:]]


def test_zero3_llama_refits_into_vllm_tp2_and_back_and_saves_and_loads(tmp_path):
    reports, engines = _run(tmp_path, 4, ours=str(tmp_path / "ours"), theirs=str(tmp_path / "theirs"))
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
    # every engine element compared with vLLM's rule on both ranks, collocated and in the engine job
    # (there the MoE's too); the step after the reverse refits ran
    assert rank0["checked"] > 0 and rank1["checked"] == rank0["checked"]
    assert [e["checked"] for e in engines] == [rank0["checked"]] * 2
    assert engines[0]["moe_checked"] == engines[1]["moe_checked"] > 0
    assert rank0["step_changed"] and rank0["loss_diff"] <= 1e-6
    _same_checkpoint(tmp_path)


def _same_checkpoint(tmp_path: Path, moe: bool = True) -> None:
    """checkpoint.save from the shards wrote what save_pretrained of the gathered model writes: the
    same files and index, byte for byte (and, said per tensor for a readable failure, every key,
    dtype, shape and bytes); the program checked the load into a fresh model. The Qwen3-MoE's too
    (one file: its experts one key each, as transformers 5 saves its stacked experts)."""
    if moe:
        moe_dir = tmp_path / "moe"
        moe_dir.mkdir()
        for side in ("ours", "theirs"):
            (tmp_path / f"{side}_moe").rename(moe_dir / side)
        names = sorted(p.name for p in (moe_dir / "theirs").glob("*.safetensors"))
        assert names == ["model.safetensors"] == sorted(p.name for p in (moe_dir / "ours").glob("*.safetensors"))
        ours = (moe_dir / "ours" / names[0]).read_bytes()
        theirs = (moe_dir / "theirs" / names[0]).read_bytes()
        with safe_open(str(moe_dir / "theirs" / names[0]), "pt") as f:
            assert "model.layers.0.mlp.experts.3.down_proj.weight" in f.keys()  # per expert, as checkpoints are
        assert ours == theirs
    files = sorted(p.name for p in (tmp_path / "theirs").glob("*.safetensors"))
    assert len(files) > 1 and files == sorted(p.name for p in (tmp_path / "ours").glob("*.safetensors"))
    index = "model.safetensors.index.json"
    assert json.loads((tmp_path / "ours" / index).read_text()) == json.loads((tmp_path / "theirs" / index).read_text())
    for name in files + [index]:
        assert (tmp_path / "ours" / name).read_bytes() == (tmp_path / "theirs" / name).read_bytes(), name
    for name in files:
        with safe_open(str(tmp_path / "ours" / name), "pt") as ours, \
                safe_open(str(tmp_path / "theirs" / name), "pt") as theirs:
            assert sorted(ours.keys()) == sorted(theirs.keys()), name
            for key in theirs.keys():
                assert ours.get_slice(key).get_dtype() == theirs.get_slice(key).get_dtype(), key
                want = theirs.get_tensor(key)
                got = ours.get_tensor(key)
                assert got.shape == want.shape and torch.equal(got.view(torch.uint8), want.view(torch.uint8)), key


def test_zero3_on_two_ranks_refits_an_engine_job_of_two_more_and_back(tmp_path):
    """ZeRO-3 over a world of 2 (the Llama and the MoE) and the engine job of 2 more ranks: the same
    refits both ways as on 4, checked the same way, and the same save and load."""
    reports, engines = _run(tmp_path, 2, ours=str(tmp_path / "ours"), theirs=str(tmp_path / "theirs"))
    text = reports[0]["text"]
    assert reports[1]["text"] == text and "mesh zero (dp=2)\n" in text
    # over 2 ranks: the norm's 6 elements are 3 a rank, the embedding's 222 are 111, no padding;
    # the MoE's stacked gate_up_proj 4 x 10 x 6 = 240, 120 a rank
    assert "tensor model.norm.weight.ds_tensor [flat([6] as model.norm.weight) pad dp over dp]\n" in text
    for r in reports:
        assert r["local_numel"]["model.norm.weight.ds_tensor"] == 3
        assert r["local_numel"]["model.embed_tokens.weight.ds_tensor"] == 111
    assert reports[0]["moe_text"] == reports[1]["moe_text"]
    assert "tensor model.layers.0.mlp.experts.gate_up_proj.ds_tensor [flat(" in reports[0]["moe_text"]
    assert [e["checked"] for e in engines] == [reports[0]["checked"]] * 2 and reports[0]["checked"] > 0
    assert engines[0]["moe_checked"] == engines[1]["moe_checked"] > 0
    assert reports[0]["step_changed"] and reports[0]["loss_diff"] <= 1e-6
    _same_checkpoint(tmp_path)


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
