"""The "memory" transport (layoutlang/runtime/transport_memory.py): the runtime's suite on it.

Every refit here runs in local worker processes (`layoutlang.runtime.worker.run`: the layouts'
fill from logical coordinates, every destination element checked against
layoutlang/runtime/fill.py's expectation, written from the layouts, not from the runtime)
with `transport="memory"`, each channel read with `process_vm_readv` ("cma") or forced
through a shared-memory ring ("ring"). The fault-free cases share one launch of 8 ranks
(tests/shared_launch.py); the fault table runs tests/test_runtime_faults.py's pair and
faults on it. The channel layer (`MemoryLinks`) is also checked on its own, in one process
pair: order, sizes, a FIFO and a ring smaller than what is posted at once.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
import torch

from layoutlang.compiler import compile_plan
from layoutlang.runtime import memlinks
from layoutlang.runtime.launch import launch
from layoutlang.runtime.transport import transport_class
from layoutlang.runtime.transport_memory import MemoryTransport
from shared_launch import launch_cases
from test_replay import REPLICAS, TRAIN as RELAY_TRAIN
from test_runtime import INFER, TRAIN
from test_runtime_faults import DST as FAULT_DST, NPROC as FAULT_NPROC, SLACK, SRC as FAULT_SRC, TIMEOUT

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SMALL = os.path.join(ROOT, "examples", "small")
NPROC = 8
RING = {"mode": "ring", "ring_bytes": 4096}  # a ring smaller than most messages: chunks wrap around it


def _small(name: str) -> str:
    return os.path.join(SMALL, f"{name}.layout")


@pytest.fixture(scope="module")
def suite(tmp_path_factory):
    """Every fault-free case, on "memory" and on "memory" forced to rings, in one launch."""
    d = tmp_path_factory.mktemp("memory")
    for name, text in (("train", TRAIN), ("infer", INFER), ("relay_train", RELAY_TRAIN), ("replicas", REPLICAS)):
        (d / f"{name}.layout").write_text(text)
    quant = {"src": str(d / "train.layout"), "dst": str(d / "infer.layout")}  # mxfp8, fp8_e4m3, fp16, padding, gtp
    relays = {"src": str(d / "relay_train.layout"), "dst": str(d / "replicas.layout")}
    llama = {"src": _small("llama_train"), "dst": _small("llama_infer")}
    moe = {"src": _small("moe_train"), "dst": _small("moe_infer")}
    v2 = {"src": _small("v2/llama_megatron"), "dst": _small("v2/llama_vllm")}
    cases = []
    for kind, options in (("cma", None), ("ring", RING)):
        on = {"transport": "memory", **({"transport_options": options} if options else {})}
        cases += [(f"{kind}-quantized-buckets", {**quant, **on, "verify": True, "budget": 1024, "steps": 2}),
                  (f"{kind}-strided", {**quant, **on, "verify": True, "budget": 1024, "strided": True}),
                  (f"{kind}-overlap", {**quant, **on, "budget": 1024, "steps": 3, "overlap": True}),
                  (f"{kind}-steady-relays", {**relays, **on, "steady": True, "alternate": True, "steps": 5}),
                  (f"{kind}-llama", {**llama, **on, "verify": True})]
    cases += [("cma-moe", {**moe, "transport": "memory", "verify": True}),
              ("cma-v2-mxfp8", {**v2, "transport": "memory", "verify": True, "steady": True, "steps": 3})]
    out = launch_cases(cases, NPROC, timeout=240)
    out["plans"] = {"quant": compile_plan(quant["src"], quant["dst"]), "relays": compile_plan(relays["src"], relays["dst"])}
    return out


def _ok(results, name):
    assert results is not None, f"the launch did not reach `{name}`"
    for r in results:
        assert r.ok, f"{name}: rank {r.rank}: {r.error} {r.result and r.result.get('check_errors')} {r.stderr[-800:]}"


@pytest.mark.timeout(300)
@pytest.mark.parametrize("kind", ["cma", "ring"])
def test_every_case_is_exact_on_the_memory_transport(suite, kind):
    names = [n for n in suite if n.startswith(kind + "-")]
    assert len(names) >= 5
    for name in names:
        _ok(suite[name], name)
        modes = {r.result["transport_mode"] for r in suite[name] if r.result["sent_bytes"] + r.result["received_bytes"]}
        assert modes == {kind}, (name, modes)  # (this machine permits process_vm_readv between siblings)
    # the quantized pair: every destination element once per step (the bytes of the wire rule)
    plan = suite["plans"]["quant"]
    assert any(op.wire for op in plan.ops)  # mxfp8 blocks on the wire
    quantized = suite[f"{kind}-quantized-buckets"]
    assert sum(r.result["received_bytes"] + r.result["local_bytes"] for r in quantized) == sum(op.bytes for op in plan.ops)
    # relays forward what they received; steady steps 3-5 replay step 2's record, sources rewritten in place
    assert any(op.after for op in suite["plans"]["relays"].ops)
    steady = suite[f"{kind}-steady-relays"]
    assert all(r.result["replayed"] == 3 for r in steady if r.result["checked_tensors"]), [
        r.result["replayed"] for r in steady]
    assert sum(r.result["staged_ahead"] for r in suite[f"{kind}-overlap"]) > 0


def test_the_registry_builds_it_and_the_mode_is_checked():
    assert transport_class("memory") is MemoryTransport
    with pytest.raises(ValueError, match="'cma' or 'ring'"):
        MemoryTransport(mode="fast")
    assert MemoryTransport(mode="ring").mode is None  # (nothing connected yet)


@pytest.fixture
def fault_pair(tmp_path):
    (tmp_path / "src.layout").write_text(FAULT_SRC)
    (tmp_path / "dst.layout").write_text(FAULT_DST)
    return {"src": str(tmp_path / "src.layout"), "dst": str(tmp_path / "dst.layout"), "timeout": TIMEOUT,
            "pg_timeout": 300, "budget": 600, "transport": "memory"}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("fault", ["killed", "stalled"])
def test_a_peer_killed_or_stalled_mid_bucket_is_named_by_every_survivor_in_time(fault_pair, fault):
    """tests/test_runtime_faults.py's pair (every rank sends in bucket 1) on "memory": rank 1 is
    SIGKILLed, or sleeps, as bucket 1 starts, while the others have posted theirs. Every
    survivor fails step 1 in bucket 1 within timeout + 1 s naming rank 1: a killed one at once
    by its process's exit (each survivor sends to rank 1, a destination rank), a stalled one
    by the deadline; and the Refitter says at once that it cannot be reused."""
    fault_job = {"die": {"rank": 1, "bucket": 1, "after": 0.3, "kill": True}} if fault == "killed" else {
        "stall": {"rank": 1, "bucket": 1, "seconds": 4}}
    results = launch({**fault_pair, "retry": True, **fault_job}, FAULT_NPROC, timeout=90)
    if fault == "killed":
        assert results[1].returncode == -9
    for r in results:
        if r.rank == 1:
            continue
        first, again = r.result["outcomes"]
        assert first["seconds"] <= TIMEOUT + SLACK, first
        assert first["error"].startswith(f"error: rank {r.rank}: step 1, bucket 1: "), first
        assert first["peers"] == [1] and first["reusable"] is False, first
        if fault == "killed":
            assert re.search(r"peer rank 1 died \(process \d+ exited\)", first["error"]), first
        else:
            assert "peer rank 1 did not complete it within 2 s" in first["error"], first
        assert again["error"].startswith(f"error: rank {r.rank}: step 2, setup: this Refitter cannot be reused: "
                                         "step 1 failed in bucket 1: "), again


@pytest.mark.timeout(120)
def test_a_rank_that_never_arrives_is_named_by_everyone_in_time(fault_pair):
    results = launch({**fault_pair, "stall_before": {"rank": 2, "seconds": 3}, "linger": 4}, FAULT_NPROC, timeout=90)
    for r in results:
        if r.rank == 2:
            continue
        first = r.result["outcomes"][0]
        assert first["error"].startswith(f"error: rank {r.rank}: step 1, agreement: rank 2 did not start step 1 "
                                         "within 2 s"), first
        assert first["peers"] == [2] and first["seconds"] <= TIMEOUT + SLACK, first
