"""Transports between jobs (docs/jobs.md "Transports"): the fault rules of docs/jobs.md hold when
the bytes move through shared memory or NIXL. ONE deployment per transport
(tests/test_jobs_faults.py's: a trainer job of 2 ranks and replicas of TP2, each process its
own job, forked from a warm zygote), `TrainerJob(..., transport=...)`, "memory" with 3
replicas, "nixl" with 2:

    refits 1-3     every replica exact; each trainer rank's JobReport.transports says memory
                   for each replica (cma where this kernel lets a rank read its peers, else
                   ring), or "nixl (UCX)"
    kills          a replica rank SIGKILLed as bucket 0, then bucket 3 starts (the trainer's
                   bytes moving into it): that replica alone missed, both trainer ranks back
                   within timeout + 1 s, the others exact; the replica restarted under its id
                   (a new group: new links, new NIXL agents) is exact at the next refit
    a stall        a replica rank stops itself (SIGSTOP) as bucket 1 starts: that replica alone
                   missed, well within the timeout; continued, its ranks fail that refit and
                   the replica is exact at the next one, without a restart
    agreement      ("memory") a replica asking for transport="group" is refused with the
                   reason; the others exact
    between refits ("nixl") a replica rank SIGKILLed while it waits in `receive`: the next refit
                   (its group's agents kept) drops that replica alone, within timeout + 1 s
    never arrives  ("nixl") a replica that joined but never waits in `receive`, expected by a
                   refit: missed, the trainer back within timeout + 1 s, the others exact (the
                   restarted replica too)

"auto" (the default) is the same transport as "memory" here (every pair on one host):
tests/test_jobs_faults.py runs the whole fault matrix on it and checks its reports say so.
Every element of every replica is checked against the version it reports
(examples/jobs/weights.py, from the layout's coordinates).
"""

from __future__ import annotations

import json
import os
import signal

import pytest

from layoutlang.runtime import cma, memlinks
from layoutlang.runtime.launch import free_port
from test_transport_nixl import _nixl_or_skip
from test_jobs_faults import BUDGET, INFER, ROOT, SLACK, TIMEOUT, Deployment, _exact

REPLICAS = ("r0", "r1", "r2")
NIXL = ("r0", "r1")   # "nixl": the trainer job and 2 replicas


def _memory() -> str:
    # where Yama's policy is 0 or 1 (each rank allows its readers) a receiver reads its sender
    return "memory (cma)" if cma.available() and cma.ptrace_scope() in (None, 0, 1) else "memory (ring)"


@pytest.mark.timeout(300)
@pytest.mark.parametrize("transport", ["memory", "nixl"])
def test_between_jobs_every_fault_rule_holds(tmp_path, transport):
    if transport == "nixl":
        _nixl_or_skip()
    train = tmp_path / "train.layout"  # the examples' trainer on TP2 alone: 2 ranks
    train.write_text((ROOT / "examples" / "jobs" / "train.layout").read_text().replace("arg DP = 2", "arg DP = 1"))
    (tmp_path / "config.json").write_text(json.dumps({
        "address": f"127.0.0.1:{free_port()}", "train": str(train), "infer": str(INFER), "timeout": TIMEOUT,
        "budget": BUDGET, "shutdown": 2 * TIMEOUT, "transport": transport, "engine_transport": {"gr": "group"}}))
    d = Deployment(tmp_path)
    try:
        _scenario(d, transport)
    finally:
        (tmp_path / "stop").touch()
        d.close()


def _scenario(d: Deployment, transport: str) -> None:
    replicas = REPLICAS if transport == "memory" else NIXL
    carrier = _memory() if transport == "memory" else "nixl (UCX)"
    for rank in range(2):
        d.start(("trainer", rank), "trainer", str(rank))
    receives = {}
    for rid in replicas:
        for rank in range(2):
            d.start((rid, rank), "engine", rid, str(rank), *(["strided"] if rid == "r0" else []))
            receives[(rid, rank)] = 0

    def refit(**extra) -> tuple[int, dict]:
        for who in receives:
            d.until(lambda who=who: d.waiting(who))
        n = d.refit(expect=list(replicas), **extra)
        return n, d.report(n)

    def took(report: dict) -> float:
        return report["at"] - report["began"]

    def exact(rids) -> None:
        for rid in rids:
            for rank in range(2):
                receives[(rid, rank)] += 1
            _exact(d, rid, 10 * d.n, receives[(rid, 0)])

    for _ in range(3):
        n, report = refit()
        assert report.get("replicas") == list(replicas), report
        exact(replicas)
        for trainer_rank in range(2):
            assert d.report(n, trainer_rank)["transports"] == {rid: carrier for rid in replicas}, d.report(n, trainer_rank)

    def one_missed(n: int, report: dict, rid: str, where: str) -> None:
        assert report.get("missed") == [rid], (where, report)
        assert report["replicas"] == sorted(set(replicas) - {rid}), (where, report)
        assert f"replica {rid}" in report["reasons"][rid], (where, report)
        for trainer_rank in range(2):
            assert took(d.report(n, trainer_rank)) <= TIMEOUT + SLACK, (where, trainer_rank, d.report(n, trainer_rank))
        exact(set(replicas) - {rid})

    for rid, rank, bucket in (("r1", 1, 0), (replicas[-1], 0, 3)):
        (d.where / f"kill-{rid}-{rank}.json").write_text(json.dumps({"refit": d.n + 1, "bucket": bucket, "after": 0}))
        n, report = refit()
        where = f"killed {rid} rank {rank} at bucket {bucket} of refit {n}"
        one_missed(n, report, rid, where)
        assert d.exit_code(d.pids[(rid, rank)]) == -signal.SIGKILL, where
        other = (rid, 1 - rank)  # it fails this refit at once (the trainer severed), then waits again
        row = d.lines(other, receives[other] + 1)[-1]
        assert "error" in row and f"replica {rid} rank {1 - rank}: refit {n}" in row["error"], (where, row)
        d.kill(other)
        for r in range(2):  # the replica restarts under its id
            d.start((rid, r), "engine", rid, str(r))
            receives[(rid, r)] = 0
        refit()
        exact(replicas)

    # a stalled rank: stopped as bucket 1 starts, alive, not reading
    stalled = ("r1", 0)
    (d.where / "kill-r1-0.json").write_text(json.dumps({"refit": d.n + 1, "bucket": 1, "after": 0, "pause": True}))
    n, report = refit()
    one_missed(n, report, "r1", f"stopped r1 rank 0 at bucket 1 of refit {n}")
    assert "stopped" in report["reasons"]["r1"], report
    os.kill(d.pids[stalled], signal.SIGCONT)
    for r in range(2):  # both fail refit n and wait again, whole: the next refit takes them
        row = d.lines(("r1", r), receives[("r1", r)] + 1)[-1]
        assert "error" in row and f"replica r1 rank {r}: refit {n}" in row["error"], row
        receives[("r1", r)] += 1
    refit()
    exact(replicas)
    if transport == "nixl":
        # a replica rank that dies between refits, waiting in `receive`: its group's agents are kept
        # (no connect), the walk finds its agent gone
        for who in receives:
            d.until(lambda who=who: d.waiting(who))
        d.kill(("r0", 1))
        n = d.refit(expect=list(replicas))
        one_missed(n, d.report(n), "r0", f"r0 rank 1 dead before refit {n}")
        row = d.lines(("r0", 0), receives[("r0", 0)] + 1)[-1]
        assert "error" in row and f"replica r0 rank 0: refit {n}" in row["error"], row
        d.kill(("r0", 0))
        for r in range(2):  # the replica restarts under its id
            d.start(("r0", r), "engine", "r0", str(r))
            receives[("r0", r)] = 0
        # a replica that never arrives: it joined, never waits in `receive`, and a refit expects it
        for r in range(2):
            d.start(("idle", r), "engine", "idle", str(r), "idle")
        for who in receives:
            d.until(lambda who=who: d.waiting(who))
        n = d.refit(expect=[*replicas, "idle"])
        report = d.report(n)
        assert report["replicas"] == list(replicas) and report["missed"] == ["idle"], report
        assert "did not wait in receive within" in report["reasons"]["idle"], report
        for trainer_rank in range(2):
            assert took(d.report(n, trainer_rank)) <= TIMEOUT + SLACK, d.report(n, trainer_rank)
        exact(replicas)
        d.refit(stop=True)
        for rank in range(2):
            assert d.exit_code(d.pids[("trainer", rank)], 30) == 0, d.logs()
        return

    # a replica whose own choice differs from the trainer's is refused; the others go on
    for r in range(2):
        d.start(("gr", r), "engine", "gr", str(r))
    d.until(lambda: d.waiting(("gr", 0)) and d.waiting(("gr", 1)))
    n, report = refit()
    assert report["replicas"] == list(REPLICAS) and report["missed"] == ["gr"], report
    assert report["reasons"]["gr"].startswith("replica gr refused: it asked for transport 'group' but the trainer "
                                              "job moves bytes by 'memory'"), report
    exact(REPLICAS)
    row = d.lines(("gr", 0), 1)[-1]
    assert "the trainer refused this replica: it asked for transport 'group'" in row["error"], row
    d.kill(("gr", 1))  # (its rank 0 waits again; the trainer's close ends it)

    # between refits no rank holds a channel file (each is unlinked once both ends mapped it)
    pids = {str(pid) for pid in d.pids.values()}
    left = [n for n in os.listdir(memlinks.shm_dir()) if n.startswith(memlinks.PREFIX) and n.split("-")[3] in pids]
    assert left == [], left
    d.refit(stop=True)
    for rank in range(2):
        assert d.exit_code(d.pids[("trainer", rank)], 30) == 0, d.logs()


def test_a_transport_jobs_do_not_take_is_a_usage_error(monkeypatch):
    from layoutlang.diagnostics import UsageError
    from layoutlang.runtime import EngineJob, TrainerJob, nixlagent, transport

    with pytest.raises(UsageError) as err:
        TrainerJob(str(INFER), str(INFER), address="127.0.0.1:1", rank=0, world_size=2, transport="shm")
    assert str(err.value).splitlines()[0].startswith("error: unknown transport 'shm': known are \"auto\", ")
    monkeypatch.setitem(transport.TRANSPORTS, "pigeon", "pigeons:Pigeon")  # registered from outside, as a user may
    with pytest.raises(UsageError) as err:
        EngineJob(str(INFER), address="127.0.0.1:1", replica="r0", rank=0, world_size=2, transport="pigeon")
    assert str(err.value).splitlines() == [
        "error: transport 'pigeon' is not built between jobs yet: a trainer job and its replicas move bytes by "
        "\"auto\", \"group\", \"memory\" or \"nixl\"",
        "help: leave transport out (\"auto\": shared memory between the ranks of one host, the replica's process "
        "group for the others)"]
    # "nixl" without NIXL's package: the Refitter's UsageError, saying how to install it (before any connection)
    monkeypatch.setattr(nixlagent, "MODULES", ("layoutlang_tests_no_such_nixl",))
    for make in (lambda: TrainerJob(str(INFER), str(INFER), address="127.0.0.1:1", rank=0, world_size=2,
                                    transport="nixl"),
                 lambda: EngineJob(str(INFER), address="127.0.0.1:1", replica="r0", rank=0, world_size=2,
                                   transport="nixl")):
        with pytest.raises(UsageError) as err:
            make()
        assert str(err.value).splitlines() == [
            "error: the \"nixl\" transport needs NIXL's Python package, which is not installed",
            "help: pip install 'layoutlang[nixl]' (nixl-cu12: its UCX backend moves DRAM between processes without "
            "CUDA), or choose transport=\"group\""]


class _Agent:
    """What `NixlLinks` reads of its `NixlAgent` (layoutlang/runtime/nixlagent.py), by hand: messages
    fail only when the test says so."""

    severed = False

    def __init__(self):
        self.failures = 0

    def progress(self) -> None:
        pass

    def pending(self) -> bool:
        return True

    def probe(self, peers) -> None:
        pass  # (every peer's agent is there)

    def fail(self, works, text: str) -> None:
        for w in works:
            w.error = text
            self.failures += 1


def test_a_nixl_failure_a_quiet_look_saw_still_fails_its_replicas_wait():
    """A trainer rank waiting on replica A's messages moves replica B's links quietly meanwhile
    (`memlinks.wait_all`'s `also`); a failure of B's seen there (its rank 1 closed the link)
    still fails B's own wait at its first look, naming that rank, not at the deadline."""
    import time

    from layoutlang.runtime.memlinks import LinkError, wait_all
    from layoutlang.runtime.nixlagent import NixlLinks, Work

    a, b = NixlLinks(None, "a", 0, [1]), NixlLinks(None, "b", 0, [1])
    a.nixl, b.nixl = _Agent(), _Agent()
    wa, wb = Work(1), Work(1)
    a.works, b.works = [wa], [wb]
    b.nixl.fail([wb], "rank 1 closed the link")
    wa.done = True  # (A's message arrives while B's links are moved quietly)
    wait_all([(a, wa)], time.monotonic() + 5, also=[b])
    began = time.monotonic()
    with pytest.raises(LinkError) as err:
        wait_all([(b, wb)], began + 2)
    assert (err.value.peer, err.value.reason, err.value.closed, err.value.timed_out, err.value.index) == \
        (1, "rank 1 closed the link", True, False, 0)
    assert time.monotonic() - began < 1
