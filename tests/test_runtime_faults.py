"""Faults in a refit, on real gloo processes: every survivor raises a RefitError in time.

The Refitter's timeout is 2 s; the process group's own timeout is 300 s, so
a test that passes cannot be leaning on it (it would take minutes). Each
worker reports every refit call: the error text, the phase, the peers it
blames, whether the Refitter can be reused, and how long the call took.
These rows are the failure table of docs/runtime.md.
"""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from layoutlang.compiler import compile_plan
from layoutlang.compiler.graph import buckets
from layoutlang.runtime.launch import launch

TIMEOUT = 2
SLACK = 1.0  # acceptance: every survivor raises within timeout + 1 s
NPROC = 4
BUDGET = 600

SRC = """
mesh s (tp=4)
tensor a [64 over tp, 16]
tensor b [16, 64 over tp]
tensor c [32 over tp]
"""

DST = """
mesh d (tp=2)
tensor a [64, 16 over tp]
tensor b [16 over tp, 64] fp32
tensor c [32]
"""


@pytest.fixture
def pair(tmp_path):
    (tmp_path / "src.layout").write_text(SRC)
    (tmp_path / "dst.layout").write_text(DST)
    return str(tmp_path / "src.layout"), str(tmp_path / "dst.layout")


def _job(pair, **faults):
    src, dst = pair
    return {"src": src, "dst": dst, "timeout": TIMEOUT, "pg_timeout": 300, "budget": BUDGET, **faults}


def test_the_pair_has_several_buckets_and_every_rank_sends_in_bucket_1(pair):
    """The fault tests below kill and stall ranks in bucket 1: it must exist and involve everyone."""
    plan = compile_plan(*pair)
    bucket_list = buckets(plan, BUDGET)
    assert len(bucket_list) >= 2
    b1 = bucket_list[1]
    senders = {op.src_rank for op in plan.ops if b1.first_op <= op.id < b1.stop_op and not op.local}
    assert senders == {0, 1, 2, 3}


def _survivors(results, dead):
    return [r for r in results if r.rank not in dead]


def _first(r):
    assert r.result is not None, f"rank {r.rank} wrote no result: {r.stderr[-2000:]}"
    assert r.result["outcomes"], f"rank {r.rank} never called refit: {r.result}"
    return r.result["outcomes"][0]


@pytest.mark.timeout(120)
def test_rank_that_never_calls_refit_is_named_by_everyone_in_time(pair):
    results = launch(_job(pair, stall_before={"rank": 1, "seconds": 5}, linger=8), NPROC, timeout=90)
    for r in _survivors(results, {1}):
        first = _first(r)
        assert first["error"].startswith(f"error: rank {r.rank}: step 1, agreement: rank 1 did not start step 1 within 2 s")
        assert first["peers"] == [1] and first["phase"] == "agreement" and first["reusable"] is True
        assert first["seconds"] <= TIMEOUT + SLACK, first
        assert "help: nothing is left in flight: this Refitter can be used again" in first["error"]
    late = _first(results[1])  # it arrives after the others gave up: told why at once, same step
    assert late["error"].startswith("error: rank 1: step 1, agreement: rank 1 did not start step 1 within 2 s"), late
    assert late["seconds"] <= SLACK, late


@pytest.mark.timeout(120)
def test_after_a_late_rank_the_same_refitter_refits_exactly(pair):
    """Reuse after an agreement failure: every rank failed the same step, the retry moves every element."""
    results = launch(_job(pair, stall_before={"rank": 2, "seconds": 3}, retry=True, verify=True), NPROC, timeout=90)
    for r in results:
        outcomes = r.result["outcomes"]
        assert len(outcomes) == 2 and "rank 2 did not start step 1" in outcomes[0]["error"], outcomes
        assert outcomes[1]["error"] is None, outcomes
        assert r.ok, (r.rank, r.error, r.result["check_errors"])
    assert sum(r.result["checked_tensors"] for r in results) == 6  # a, b, c on ranks 0 and 1


@pytest.mark.timeout(120)
@pytest.mark.parametrize("dead", [0, 2])
def test_rank_dead_before_refit(pair, dead):
    """Step 1 goes well; `dead` dies as step 2 starts (the others are in step 2's agreement by then;
    with `steady=True` step 2 has none: the steady tests below)."""
    results = launch(_job(pair, steps=2, die_before={"rank": dead, "step": 2, "after": 0.5}), NPROC, timeout=90)
    assert results[dead].returncode == 3
    for r in _survivors(results, {dead}):
        ok, first = r.result["outcomes"]
        assert ok["error"] is None
        assert first["seconds"] <= TIMEOUT + SLACK, first
        assert first["error"].startswith(f"error: rank {r.rank}: step 2, agreement: "), first
        if dead == 0:  # rank 0 hosts the store under env:// init: the store is gone, not a peer late
            assert "store at 127.0.0.1:" in first["error"] and "is unreachable (rank 0 hosts it" in first["error"]
            assert first["reusable"] is False and "help: destination tensors may be partly written" in first["error"]
        else:
            assert f"rank {dead} did not start step 2 within 2 s" in first["error"], first
            assert first["peers"] == [dead] and first["reusable"] is True


def _failed(r):
    """A survivor's first failed refit call, if any, and how many calls succeeded before it."""
    outcomes = r.result["outcomes"]
    bad = [i for i, o in enumerate(outcomes) if o["error"]]
    return (outcomes[bad[0]], bad[0]) if bad else (None, len(outcomes))


@pytest.mark.timeout(120)
@pytest.mark.parametrize("at", [2, 3])
def test_rank_dead_in_a_steady_step_is_named_by_its_receivers(pair, at):
    """`steady=True`: step 1 passes on every rank, so later steps have no meeting; step 2 is walked
    and recorded, step 3 replays the record on every rank without hooks (layoutlang/runtime/replay.py). Rank 2,
    a sender only (the destination has 2 ranks), dies as step `at` starts. Ranks 0 and 1 receive from
    every source rank: each fails that step within the timeout naming rank 2, and its next call
    refuses at once. Rank 3, the other sender, passes or fails naming rank 2 (through the reason a
    receiver left)."""
    results = launch(_job(pair, steps=at + 1, retry=True, steady=True,
                          die_before={"rank": 2, "step": at, "after": 0.5}), NPROC, timeout=90)
    assert results[2].returncode == 3
    for r in results[:2]:
        *ok, failed, again = r.result["outcomes"]
        assert len(ok) == at - 1 and all(o["error"] is None for o in ok), ok
        assert failed["error"].startswith(f"error: rank {r.rank}: step {at}, bucket "), failed
        assert "peer rank 2" in failed["error"] and failed["peers"] == [2], failed
        assert failed["reusable"] is False and failed["seconds"] <= 0.5 + TIMEOUT + SLACK, failed
        assert again["error"].startswith(f"error: rank {r.rank}: step {at + 1}, setup: this Refitter cannot be "
                                         f"reused: step {at} failed in bucket "), again
        assert again["seconds"] < SLACK, again
        assert r.result["replayed"] == at - 2  # step 3 ran from step 2's record
    failed, passed = _failed(results[3])
    assert passed >= at - 1, results[3].result["outcomes"]  # step 1 met; step `at` passes if its sends were taken
    if failed is not None:
        assert 2 in failed["peers"] and "peer rank 2" in failed["error"], failed
        assert failed["seconds"] <= TIMEOUT + SLACK, failed


@pytest.mark.timeout(120)
@pytest.mark.parametrize("at", [2, 3])
def test_wrong_shape_in_a_steady_step_fails_that_rank_at_once_and_its_receivers_say_why(pair, at):
    """Rank 2 passes a truncated `a` in step `at` (`steady=True`: no agreement to stop everyone first;
    in step 3 the others replay step 2's record). It raises at once, before posting anything, and
    cannot be reused; ranks 0 and 1, which wait on its transfers, fail within the timeout with its
    reason (it left it at the step's fence)."""
    results = launch(_job(pair, steps=at + 1, retry=True, steady=True, wrong_shape={"rank": 2, "step": at}), NPROC,
                     timeout=90)
    expected = "source tensor `a`: expected [16, 16] torch.bfloat16, got [1, 16] torch.bfloat16"  # [64 over tp=4, 16]
    *ok, failed, again = results[2].result["outcomes"]
    assert len(ok) == at - 1 and all(o["error"] is None for o in ok), ok
    assert failed["error"].startswith(f"error: rank 2: step {at}, check: local tensors do not match the layouts: "
                                      + expected), failed
    assert failed["reusable"] is False and failed["peers"] == [2] and failed["seconds"] < SLACK, failed
    assert (f"step {at + 1}, setup: this Refitter cannot be reused: step {at} failed in check: "
            in again["error"]), again
    for r in results[:2]:
        failed, passed = _failed(r)
        assert passed == at - 1 and failed is not None, r.result["outcomes"]
        assert failed["error"].startswith(f"error: rank {r.rank}: step {at}, bucket "), failed
        assert f"rank 2 failed its check in step {at}: {expected}" in failed["error"], failed
        assert failed["peers"] == [2] and failed["seconds"] <= TIMEOUT + SLACK, failed
        assert r.result["replayed"] == at - 2


@pytest.mark.timeout(120)
@pytest.mark.parametrize("fault", ["die-0", "die-1", "stall-1"])
def test_rank_dead_or_stalled_during_refit(pair, fault):
    kind, rank = fault.split("-")
    culprit = int(rank)
    # `after`: the others have left bucket 0's meeting by then, so every survivor fails in bucket 1
    faults = {"die": {"rank": culprit, "bucket": 1, "after": 0.3}} if kind == "die" else {
        "stall": {"rank": culprit, "bucket": 1, "seconds": 8}}
    results = launch(_job(pair, retry=True, **faults), NPROC, timeout=90)
    if kind == "die":
        assert results[culprit].returncode == 3
    for r in _survivors(results, {culprit}):
        first, again = r.result["outcomes"]
        assert first["seconds"] <= TIMEOUT + SLACK, first
        assert first["error"].startswith(f"error: rank {r.rank}: step 1, bucket 1: "), first
        assert first["reusable"] is False and "help: destination tensors may be partly written" in first["error"]
        if culprit == 0 and "store at" in first["error"]:
            assert "(rank 0 hosts it" in first["error"]
        else:
            assert culprit in first["peers"], first
            assert (f"peer rank {culprit}" in first["error"] or f"rank {culprit} did not finish bucket 1"
                    in first["error"]), first
        # the Refitter knows it cannot be reused, and says so at once
        assert again["error"].startswith(f"error: rank {r.rank}: step 2, setup: this Refitter cannot be reused: "
                                         "step 1 failed in bucket 1: "), again
        assert again["seconds"] < SLACK, again
        assert r.result["reusable"] is False


@pytest.mark.timeout(60)
def test_layoutc_run_refuses_thousands_of_processes():
    small = Path(__file__).parent.parent / "examples" / "small"
    proc = subprocess.run([sys.executable, "-m", "layoutlang.cli", "run", str(small / "llama_train.layout"),
                           str(small / "llama_infer.layout"), "--nproc", "5000"],
                          capture_output=True, text=True, timeout=50)
    assert proc.returncode == 2
    assert proc.stderr.splitlines() == [
        "error: --nproc 5000: `layoutc run` starts between 1 and 64 local processes (each one imports "
        "torch, about 300 MB)",
        "help: pass --max-nproc 5000 to allow it"]


def _gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().split(") ", 1)[1].startswith("Z")  # a zombie has exited
    except FileNotFoundError:
        return True


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
@pytest.mark.timeout(120)
@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM])
def test_workers_exit_when_layoutc_run_is_killed(tmp_path, pair, sig):
    pids = tmp_path / "pids"
    pids.mkdir()
    env = dict(os.environ, LAYOUTLANG_PID_DIR=str(pids))
    launcher = subprocess.Popen([sys.executable, "-m", "layoutlang.cli", "run", *pair, "--nproc", "4",
                                 "--steps", "1000000"], env=env, stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 60
        while len(list(pids.iterdir())) < 4 and time.monotonic() < deadline:
            time.sleep(0.2)
        workers = [int(p.read_text()) for p in pids.iterdir() if p.read_text()]
        assert len(workers) == 4
        time.sleep(1.0)
        assert not any(_gone(w) for w in workers)  # they are refitting, a million steps to go
        launcher.send_signal(sig)
        launcher.wait(timeout=30)
        deadline = time.monotonic() + 15
        while not all(_gone(w) for w in workers) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert [w for w in workers if not _gone(w)] == []
    finally:
        if launcher.poll() is None:
            launcher.kill()
        for p in pids.iterdir():
            try:
                os.kill(int(p.read_text()), signal.SIGKILL)
            except (ProcessLookupError, ValueError):
                pass


STEADY_STRIDED = """
import socket, sys
import torch, torch.distributed as dist
from layoutlang.compiler import compile_plan
from layoutlang.runtime import Refitter
from layoutlang.runtime.errors import RefitError
s = socket.socket(); s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]; s.close()
dist.init_process_group("gloo", rank=0, world_size=1, init_method=f"tcp://127.0.0.1:{port}")
plan = compile_plan(sys.argv[1], sys.argv[2])
refitter = Refitter(plan, steady=True, timeout=2)
src = {"w": torch.arange(32, dtype=torch.float32).reshape(8, 4).to(torch.bfloat16)}
dst = {"w": torch.zeros(8, 4, dtype=torch.bfloat16)}
refitter.refit(src, dst)                      # step 1: agreed on contiguous tensors
refitter.refit(src, dst)                      # step 2: steady
wide = torch.zeros(8, 8, dtype=torch.bfloat16)
try:
    refitter.refit(src, {"w": wide[:, ::2]})  # step 3: a non-contiguous view of the right shape
except RefitError as exc:
    print(exc.phase, exc.reusable)
    print(str(exc).splitlines()[0])
dist.destroy_process_group()
"""


@pytest.mark.timeout(60)
def test_a_non_contiguous_tensor_in_a_steady_step_is_refused_before_moving(tmp_path):
    """`steady=True` walks the buckets the ranks agreed in step 1, when every tensor was
    contiguous; a non-contiguous view later would need other cuts, so the rank refuses it (one
    process here: the check is local)."""
    (tmp_path / "src.layout").write_text("mesh s (r=1)\ntensor w [8, 4]\n")
    (tmp_path / "dst.layout").write_text("mesh d (r=1)\ntensor w [8, 4]\n")
    (tmp_path / "prog.py").write_text(STEADY_STRIDED)
    proc = subprocess.run([sys.executable, str(tmp_path / "prog.py"), str(tmp_path / "src.layout"),
                           str(tmp_path / "dst.layout")], capture_output=True, text=True, timeout=50)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.splitlines() == [
        "check False",
        "error: rank 0: step 3, check: local tensors do not match the layouts: a tensor is not contiguous, but "
        "every tensor was contiguous when the ranks agreed (pass non-contiguous tensors from the first step on, "
        "or use Refitter(steady=False))"]
