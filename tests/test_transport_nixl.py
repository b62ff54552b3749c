"""The "nixl" transport (layoutlang/runtime/transport_nixl.py): the runtime's suite on NIXL writes.

Every refit here runs in local worker processes (`layoutlang.runtime.worker.run`: the layouts'
fill from logical coordinates, every destination element checked against
layoutlang/runtime/fill.py's expectation, written from the layouts, not from the runtime)
with `transport="nixl"`: NIXL's UCX backend, DRAM to DRAM between the processes. The
fault-free cases share one launch of 4 ranks (tests/shared_launch.py): shipped pairs of
examples/small/ (the Llama trainer into the vLLM engine's mxfp8 and quantized wire, in
buckets, overlapped and strided; GPT-2's transposed Conv1D into a TP engine), relays, and
steady steps replayed while the sources are rewritten in place. The fault table runs
tests/test_runtime_faults.py's pair and faults on it: a peer SIGKILLed mid-bucket, a
stalled one, each named by every survivor within timeout + 1 s.

Without NIXL (`pip install 'layoutlang[nixl]'`) the multi-process tests skip on a developer's
machine and fail in CI (LAYOUTLANG_CI=1: scripts/setup.sh installs it).
"""

from __future__ import annotations

import os

import pytest

from layoutlang.compiler import compile_plan
from layoutlang.diagnostics import UsageError
from layoutlang.runtime import nixlagent
from layoutlang.runtime.launch import launch
from layoutlang.runtime.transport import transport_class
from layoutlang.runtime.transport_nixl import NixlTransport
from shared_launch import launch_cases
from test_relay import TRAIN as RELAY_TRAIN   # a two-rank bf16 trainer: a padded embedding, fused gate|up
from test_runtime_faults import DST as FAULT_DST, NPROC as FAULT_NPROC, SLACK, SRC as FAULT_SRC, TIMEOUT

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SMALL = os.path.join(ROOT, "examples", "small")
NPROC = 4

# four single-rank replicas of RELAY_TRAIN's model on the trainer's ranks and two more: some
# replicas forward what they received (relays); `fc1` in mxfp8 forwards packed blocks
REPLICAS = """
mesh infer (dp=4)
tensor embed as emb [100 pad 64, 32]
tensor norm [32] fp32
for l in 0..2 {
  tensor l{l}.gate_up as layers.{l}.fc1 [(gate: 32 | up: 32), 32] DTYPE
  tensor l{l}.down as layers.{l}.fc2 [32, 32]
}
"""


def _nixl_or_skip():
    try:
        nixlagent.nixl_module()
    except UsageError:
        if os.environ.get("LAYOUTLANG_CI"):
            pytest.fail("NIXL is not installed in .venv: scripts/setup.sh installs it (the `nixl` extra)")
        pytest.skip("NIXL is not installed (pip install 'layoutlang[nixl]')")


def _small(name: str) -> str:
    return os.path.join(SMALL, f"{name}.layout")


@pytest.fixture(scope="module")
def suite(tmp_path_factory):
    """Every fault-free case on "nixl", in one launch of 4 ranks."""
    _nixl_or_skip()
    d = tmp_path_factory.mktemp("nixl")
    (d / "train.layout").write_text(RELAY_TRAIN)
    (d / "mxfp8.layout").write_text(REPLICAS.replace("DTYPE", "mxfp8"))
    (d / "bf16.layout").write_text(REPLICAS.replace("DTYPE", "bf16"))
    on = {"transport": "nixl"}
    llama = {"src": _small("llama_train"), "dst": _small("llama_infer"), "args": {"DP": 1}, **on}
    gpt2 = {"src": _small("v2/gpt2_hf"), "dst": _small("v2/gpt2_tp"), "args": {"AT": 1}, **on}
    relays = {"src": str(d / "train.layout"), "dst": str(d / "mxfp8.layout"), **on}
    steady = {"src": str(d / "train.layout"), "dst": str(d / "bf16.layout"), **on}
    cases = [("llama-buckets", {**llama, "verify": True, "budget": 16 * 1024, "steps": 2}),
             ("llama-overlap-strided", {**llama, "budget": 16 * 1024, "overlap": True, "strided": True}),
             ("gpt2-transposed", {**gpt2, "verify": True}),
             ("relays-mxfp8", {**relays, "verify": True, "budget": 2048, "steps": 2}),
             ("steady-relays", {**steady, "steady": True, "alternate": True, "steps": 5})]
    out = launch_cases(cases, NPROC, timeout=150)
    out["plans"] = {name: compile_plan(job["src"], job["dst"], args=job.get("args")) for name, job in cases}
    return out


def _ok(results, name):
    assert results is not None, f"the launch did not reach `{name}`"
    for r in results:
        assert r.ok, f"{name}: rank {r.rank}: {r.error} {r.result and r.result.get('check_errors')} {r.stderr[-800:]}"


@pytest.mark.timeout(300)
def test_every_case_is_exact_on_nixl(suite):
    plans = suite["plans"]
    for name, plan in plans.items():
        _ok(suite[name], name)
        results = suite[name]
        # the bytes the plan says moved (per step), each over NIXL's UCX backend
        assert sum(r.result["sent_bytes"] for r in results) == plan.stats["network_bytes"], name
        assert sum(r.result["received_bytes"] + r.result["local_bytes"] for r in results) == plan.stats["bytes"], name
        assert {r.result["transport_mode"] for r in results if r.result["sent_bytes"] + r.result["received_bytes"]} \
            == {"UCX"}, name
        for r in results:  # every destination tensor the rank holds was checked element by element
            assert r.result["checked_tensors"] == sum(1 for t in plan.dst.tensors
                                                      if r.rank < plan.dst.ranks and t.holds(r.rank)), name
    # what each case exercises, from the plans (not from the run)
    assert any(op.wire for op in plans["llama-buckets"].ops)           # quantized (mxfp8) blocks on the wire
    assert any(op.transpose for op in plans["gpt2-transposed"].ops)    # Conv1D [in, out] -> [out, in]
    assert any(op.wire and op.after for op in plans["relays-mxfp8"].ops)  # relays forward packed blocks
    assert any(op.after for op in plans["steady-relays"].ops)
    assert sum(r.result["staged_ahead"] for r in suite["llama-overlap-strided"]) > 0
    # steady: steps 3-5 replay step 2's record (the same registered buffers), sources rewritten in place
    # in every step and every step's destination checked (`alternate`: filled, zeros, filled, ...)
    assert [r.result["replayed"] for r in suite["steady-relays"]] == [3] * NPROC


def test_the_registry_builds_it_and_a_missing_nixl_says_how_to_install_it(monkeypatch):
    assert transport_class("nixl") is NixlTransport
    monkeypatch.setattr(nixlagent, "MODULES", ("layoutlang_tests_no_such_nixl",))
    with pytest.raises(UsageError) as err:
        NixlTransport()
    assert str(err.value).splitlines() == [
        "error: the \"nixl\" transport needs NIXL's Python package, which is not installed",
        "help: pip install 'layoutlang[nixl]' (nixl-cu12: its UCX backend moves DRAM between processes without "
        "CUDA), or choose transport=\"group\""]


def test_a_write_notification_completes_only_its_own_sequences():
    """A receiver's wait completes on the notification of its own (peer, sequence): one of an
    earlier refit (a lower sequence) or of another peer leaves it pending."""
    t = nixlagent.NixlAgent.__new__(nixlagent.NixlAgent)  # the protocol's state alone: no NIXL, no store
    t.inbox = {1: {}, 2: {}}
    works = {}
    for seq in (7, 8, 9):
        works[seq] = t.inbox[1][seq] = nixlagent.Work(1)
    t._on_data(1, nixlagent.RUN.pack(nixlagent.DATA, 4, 3))   # refit n's 4..6, late
    t._on_data(2, nixlagent.RUN.pack(nixlagent.DATA, 7, 3))   # another peer's 7..9
    assert not any(w.done for w in works.values())
    t._on_data(1, nixlagent.RUN.pack(nixlagent.DATA, 7, 2))
    assert [works[s].done for s in (7, 8, 9)] == [True, True, False]


STEADY = """
import json, os, sys
from datetime import timedelta
import torch, torch.distributed as dist
from layoutlang.compiler import compile_plan
from layoutlang.runtime import Refitter

job = json.load(open(sys.argv[1]))
rank = int(os.environ["RANK"])
dist.init_process_group("gloo", timeout=timedelta(seconds=60))
refitter = Refitter(compile_plan(job["src"], job["dst"]), transport="nixl", steady=True, timeout=30)
t = refitter.transport
full = torch.arange(8 * 16, dtype=torch.float32).reshape(8, 16).to(torch.bfloat16)
src = {"w": torch.empty(8, 8, dtype=torch.bfloat16)}
dst = {"w": torch.zeros(4, 16, dtype=torch.bfloat16)}
seen = []
for step in range(1, job["steps"] + 1):
    src["w"].copy_(full[:, 8 * rank:8 * rank + 8] * step)   # the trainer's weights, rewritten in place
    refitter.refit(src, dst)
    seen.append({"exact": torch.equal(dst["w"], full[4 * rank:4 * rank + 4] * step),
                 "registrations": t.agent.registrations, "kept": len(t.agent.xfers), "replayed": refitter.replayed})
carriers = {str(peer): what for peer, what in refitter.transports.items()}
refitter.close()
json.dump({"ok": True, "steps": seen, "carriers": carriers, "closed": t.agent.closed and not t.agent.regs},
          open(sys.argv[2], "w"))
dist.destroy_process_group()
"""


@pytest.mark.timeout(120)
def test_steady_steps_register_nothing_and_post_the_kept_transfers_again(tmp_path):
    """Two ranks, tests/test_transport.py's pair (rank r holds columns 8r..8r+8, receives rows
    4r..4r+4: its block from the other rank lands in a staged buffer), steady steps with the
    sources rewritten in place: every step exact (by hand); the storages (sources, staging)
    are registered in the walked steps, never again while steps replay, and
    the transfer of each pair's round is kept and posted again; `close` deregisters them."""
    _nixl_or_skip()
    (tmp_path / "src.layout").write_text("mesh s (tp=2)\ntensor w [8, 16 over tp]\n")
    (tmp_path / "dst.layout").write_text("mesh d (tp=2)\ntensor w [8 over tp, 16]\n")
    (tmp_path / "prog.py").write_text(STEADY)
    job = {"src": str(tmp_path / "src.layout"), "dst": str(tmp_path / "dst.layout"), "steps": 5}
    results = launch(job, 2, timeout=100, program=str(tmp_path / "prog.py"))
    assert all(r.ok for r in results), "\n".join(f"rank {r.rank}: {r.error} {r.stderr[-800:]}" for r in results)
    for r in results:
        steps = r.result["steps"]
        assert [s["exact"] for s in steps] == [True] * 5
        assert [s["replayed"] for s in steps] == [0, 0, 1, 2, 3]  # steps 3-5 run step 2's record
        assert steps[0]["registrations"] >= 2  # its source and its staged receive's buffer at least
        # (step 2 carves the staging arena that step 1 sized: its block is registered then)
        assert len({s["registrations"] for s in steps[1:]}) == 1, steps
        assert all(s["kept"] >= 1 for s in steps)
        assert r.result["carriers"] == {str(1 - r.rank): "nixl (UCX)"}  # what the refit's stats name
        assert r.result["closed"]


@pytest.fixture
def fault_pair(tmp_path):
    _nixl_or_skip()
    (tmp_path / "src.layout").write_text(FAULT_SRC)
    (tmp_path / "dst.layout").write_text(FAULT_DST)
    return {"src": str(tmp_path / "src.layout"), "dst": str(tmp_path / "dst.layout"), "timeout": TIMEOUT,
            "pg_timeout": 300, "budget": 600, "transport": "nixl"}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("fault", ["killed", "stalled"])
def test_a_peer_killed_or_stalled_mid_bucket_is_named_by_every_survivor_in_time(fault_pair, fault):
    """tests/test_runtime_faults.py's pair (every rank sends in bucket 1) on "nixl": rank 1 is
    SIGKILLed 0.3 s into bucket 1, or sleeps there, while the others have posted theirs. Every
    survivor fails step 1 in bucket 1 within timeout + 1 s naming rank 1, itself or through the
    reason a survivor left at the fence: a killed rank's agent is gone (a waiting rank's
    notification to it fails), a stalled one's is there but owes its messages past the
    deadline; and its Refitter says at once that it cannot be reused."""
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
            assert "with peer rank 1 failed: peer rank 1's NIXL agent is gone (NIXL_ERR_REMOTE_DISCONNECT)" \
                in first["error"], first
        else:
            assert "with peer rank 1 failed: peer rank 1 did not complete it within 2 s" in first["error"], first
        assert again["error"].startswith(f"error: rank {r.rank}: step 2, setup: this Refitter cannot be reused: "
                                         "step 1 failed in bucket 1: "), again
        assert again["seconds"] < SLACK, again


@pytest.mark.timeout(120)
def test_a_peer_dead_in_a_replayed_steady_step_is_named_by_its_receivers(fault_pair):
    """`steady=True`: step 1 meets, step 2 is walked and recorded, step 3 replays the record (no
    meeting, the kept transfers posted again); rank 2, a sender only, exits as step 3 starts.
    Ranks 0 and 1 receive from it: each fails step 3 within the timeout naming rank 2."""
    results = launch({**fault_pair, "steps": 4, "retry": True, "steady": True,
                      "die_before": {"rank": 2, "step": 3, "after": 0.5}}, FAULT_NPROC, timeout=90)
    assert results[2].returncode == 3
    for r in results[:2]:
        *ok, failed, again = r.result["outcomes"]
        assert len(ok) == 2 and all(o["error"] is None for o in ok), ok
        assert failed["error"].startswith(f"error: rank {r.rank}: step 3, bucket "), failed
        assert "peer rank 2" in failed["error"] and failed["peers"] == [2], failed
        assert failed["seconds"] <= 0.5 + TIMEOUT + SLACK, failed
        assert r.result["replayed"] == 1  # step 3 ran from step 2's record
