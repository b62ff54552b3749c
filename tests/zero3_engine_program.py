"""The vLLM engine of tests/test_bridge_deepspeed.py: a TP2 replica as its own job (its own world of
2 gloo ranks), apart from the ZeRO-3 trainer's job (tests/deepspeed_zero3_program.py), as a
disaggregated RL deployment runs them (docs/jobs.md). They meet only at the refit's store.

For each model (the tiny Llama, then the tiny Qwen3-MoE at EP2):

1. `EngineJob(...).receive` of the trainer's refit from its `ds_tensor`s: every element equals
   vLLM's rule applied to the full parameters DeepSpeed's `GatheredParameters` gave the trainer
   (its rank 0 wrote them to FULL.safetensors before the refit opened);
2. the engine's values turned into 1 - x, and this job refits the trainer back (a `TrainerJob` of
   the engine's layout, the trainer's ranks waiting in `EngineJob.receive` with their
   `ds_tensor`s): the trainer checks every `ds_tensor` against DeepSpeed's partition rule applied to
   1 - (what it gathered).

Its processes are the last 2 of the trainer program's launch (`own_world` there gives them their
own world); both jobs meet in the store the test hosts (`job["store"]`, a prefix per refit
direction and model).
"""

from __future__ import annotations

import os
from datetime import timedelta

import torch

from deepspeed_zero3_program import CONFIG, MOE, TP, job_store, moe_vllm_expected, vllm_expected

TIMEOUT = 60.0  # seconds a refit may take; the trainer's job waits up to 90 s for this replica


def written(path: str, what: str) -> str:
    if not os.path.exists(path):
        raise AssertionError(f"the trainer wrote no {what} at {path} before its refit")
    return path


def one_model(job: dict, rank: int, tag: str, config: dict, sizes: dict, expected) -> int:
    from safetensors.torch import load_file

    from layoutlang.bridges.families import layout_text
    from layoutlang.elaborate import loads
    from layoutlang.runtime import EngineJob, TrainerJob

    engine_layout = loads(layout_text(config, "vllm", {"TP": TP, "AT": 0, **sizes}), path=f"<vllm {tag}>")
    tensors = {t.name: torch.full(t.local_shape_at(rank), float("nan")) for t in engine_layout.tensors}
    eng = EngineJob(engine_layout, store=job_store(job, tag + "_out"), replica="vllm", rank=rank,
                    world_size=TP, timeout=timedelta(seconds=TIMEOUT), connect_timeout=timedelta(seconds=30))
    version = eng.receive(tensors, wait=timedelta(seconds=90))  # (a trainer that failed: this fails too)
    eng.close()
    assert version == 1, version
    full = load_file(written(os.path.join(job["dir"], f"{tag}_full.safetensors"), "gathered parameters"))
    want = expected(full, rank)
    assert sorted(want) == sorted(tensors), (sorted(want), sorted(tensors))
    checked = 0
    for name, t in want.items():
        assert torch.equal(tensors[name], t), f"{tag}: engine {name} on rank {rank} differs from the gathered weights"
        checked += t.numel()

    # back: this job refits the trainer's ds_tensors from 1 - x
    with torch.no_grad():
        for t in tensors.values():
            t.neg_().add_(1.0)
    with open(written(os.path.join(job["dir"], f"{tag}.layout"), "layout")) as f:
        zero3 = loads(f.read(), path=f"<zero3 {tag}>")
    back = TrainerJob(engine_layout, zero3, store=job_store(job, tag + "_back"), rank=rank,
                      world_size=TP, timeout=timedelta(seconds=TIMEOUT), expect_wait=timedelta(seconds=90))
    report = back.refit(tensors, version=2, expect=("zero3",))
    back.close()
    assert list(report.replicas) == ["zero3"] and not report.missed, (report.replicas, report.missed)
    return checked


def main(job: dict, rank: int) -> dict:
    return {"rank": rank,
            "checked": one_model(job, rank, "llama", CONFIG, {}, vllm_expected),
            "moe_checked": one_model(job, rank, "moe", MOE, {"EP": 2}, moe_vllm_expected)}

