"""A fault costs only the replica it happens to (docs/jobs.md, the failure table; issue 49 item 1),
on the default transport ("auto": shared memory, every rank on this host), between separately launched jobs: a trainer job of 2 ranks and 3 replicas of TP2, each
process its own job (tests/jobs_fault_program.py, forked from a warm parent so that a replica
restarts in well under a second), all in ONE long-lived deployment:

    the fault matrix   a replica rank SIGKILLed as bucket k of a refit starts, k = 0..4, and in
                       the middle of the last bucket (the trainer rank that sends to it there holds
                       its part back, the rank dies while it waits for it), 3 runs each, the victims
                       taking turns over r1 and r2 and both ranks; in one run of the three the
                       replica's launcher also stops its other rank as that bucket starts (SIGTERM,
                       a graceful shutdown that leaves the process alive for a while, as torchrun's
                       and vLLM's do): every run the other two
                       replicas hold the new version exactly, both trainer ranks return within
                       timeout + 1 s, and the report names the killed replica alone;
    restarts           after each kill the replica restarts under its id: the rank that
                       survived is SIGKILLed after it re-entered `receive` (its wait stays in
                       the store), the killed rank restarts first and the next refit, which
                       expects the replica, begins before the other rank has started: the
                       replica is refit exactly, its predecessor's waits never counted, and the
                       refit takes no longer than one without the restart, plus 1 s, counted
                       from when the restarted replica's last rank waits;
    expect=            a replica that joined but never receives, expected by a refit: the
                       others are exact, the trainer returns within timeout + 1 s, the absent
                       one is missed "did not wait in receive within ...";
    quiet              the engines idle in `receive` for 20 s, then the trainer closes and
                       exits: no engine rank has written a single line to stderr.

Every element of every replica is checked against the version it reports
(examples/jobs/weights.py: each version has its own values, from the layout's coordinates).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from layoutlang import load
from layoutlang.compiler import compile_plan
from layoutlang.compiler.members import replicate
from layoutlang.compiler.steps import schedule
from layoutlang.runtime.launch import free_port

ROOT = Path(__file__).resolve().parents[1]
PROGRAM = Path(__file__).with_name("jobs_fault_program.py")
INFER = ROOT / "examples" / "jobs" / "infer.layout"
TIMEOUT = 4.0        # s, a refit's timeout (every rank's)
SLACK = 1.0          # acceptance: within timeout + 1 s
BUDGET = 65536       # with r0's strided destinations every rank cuts its buckets as staged: 6 of them
RUNS = 3
IDLE = 20.0          # s the engines wait in `receive` before the trainer closes
REPLICAS = ("r0", "r1", "r2")
VICTIMS = (("r1", 1), ("r2", 0), ("r1", 0), ("r2", 1))  # taking turns (r0, strided, stays)


class Deployment:
    """The zygote that forks every process, their pids and exit codes, the refits' files."""

    def __init__(self, where: Path):
        self.where = where
        self.zygote = subprocess.Popen([sys.executable, "-m", "layoutlang.runtime.zygote"], cwd=ROOT,
                                       stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                       env={**os.environ, "LAYOUTLANG_LAUNCHER_PID": str(os.getpid())})
        self.pids: dict[tuple, int] = {}        # (replica, rank) or ("trainer", rank) -> its live process
        self.stderr: dict[int, Path] = {}
        self.exits: dict[int, int] = {}
        self._answers: list[int] = []
        self._cv = threading.Condition()
        threading.Thread(target=self._read, daemon=True).start()
        self.n = 0

    def _read(self) -> None:
        for raw in self.zygote.stdout:
            line = json.loads(raw)
            with self._cv:
                if "pid" in line:
                    self._answers.append(line["pid"])
                else:
                    self.exits[line["exit"]] = line["code"]
                self._cv.notify_all()

    def start(self, who: tuple, *args: str) -> int:
        err = self.where / f"{'-'.join(map(str, who))}-{len(self.stderr)}.err"
        request = {"argv": [str(self.where), *args], "env": dict(os.environ), "cwd": str(ROOT),
                   "stderr": str(err), "program": str(PROGRAM)}
        with self._cv:
            self.zygote.stdin.write((json.dumps(request) + "\n").encode())
            self.zygote.stdin.flush()
            assert self._cv.wait_for(lambda: self._answers, 30), "the zygote did not fork"
            pid = self._answers.pop(0)
        self.pids[who], self.stderr[pid] = pid, err
        return pid

    def exit_code(self, pid: int, within: float = 10.0) -> int | None:
        with self._cv:
            self._cv.wait_for(lambda: pid in self.exits, within)
            return self.exits.get(pid)

    def kill(self, who: tuple) -> None:
        pid = self.pids[who]
        if pid not in self.exits:
            os.kill(pid, signal.SIGKILL)
        assert self.exit_code(pid) == -signal.SIGKILL, (who, self.exits.get(pid))

    def refit(self, **command) -> int:
        self.n += 1
        path = self.where / f"refit-{self.n}.json"
        (self.where / "gate.part").write_text(json.dumps(command))
        (self.where / "gate.part").replace(path)
        return self.n

    def report(self, n: int, rank: int = 0, within: float = 60.0) -> dict:
        path = self.where / f"report-{n}-{rank}.json"
        deadline = time.monotonic() + within
        while not path.exists():
            assert time.monotonic() < deadline, f"no report of refit {n} from trainer rank {rank}: {self.logs()}"
            time.sleep(0.01)
        return json.loads(path.read_text())

    def lines(self, who: tuple, count: int, within: float = 30.0) -> list[dict]:
        """The first `count` receives of a replica rank's live process (waiting for them)."""
        path = self.where / f"engine-{who[0]}-{who[1]}-{self.pids[who]}.jsonl"
        deadline = time.monotonic() + within
        while True:
            text = path.read_text() if path.exists() else ""
            rows = [json.loads(x) for x in text[:text.rfind("\n") + 1].splitlines()]
            if len(rows) >= count:
                return rows
            assert time.monotonic() < deadline, f"{who} wrote {len(rows)} of {count} receives: {self.logs()}"
            time.sleep(0.01)

    def waiting(self, who: tuple) -> bool:
        """Has this replica rank's process written its wait (what `receive` does first)? Read
        from the store as a user could, the wait key being set."""
        from torch.distributed import PrefixStore, TCPStore
        from datetime import timedelta
        if not hasattr(self, "_store"):
            host, port = json.loads((self.where / "config.json").read_text())["address"].rsplit(":", 1)
            self._store = PrefixStore("layoutlang/jobs/", TCPStore(host, int(port), None, False,
                                                                   timedelta(seconds=30)))
        key = f"replica/{who[0]}/wait/{who[1]}"
        return bool(self._store.check([key]) and self._store.get(key))

    def until(self, what, within: float = 60.0, step: float = 0.01) -> float:
        deadline = time.monotonic() + within
        while not what():
            assert time.monotonic() < deadline, f"timed out: {self.logs()}"
            time.sleep(step)
        return time.time()

    def logs(self) -> str:
        out = []
        for pid, path in sorted(self.stderr.items()):
            text = path.read_text(errors="replace").strip().splitlines() if path.exists() else []
            if text:
                out.append(f"\n--- {path.name}: " + " | ".join(text[-3:])[:600])
        return "".join(out)

    def close(self) -> None:
        for pid in self.stderr:
            if pid not in self.exits:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        self.zygote.stdin.close()
        self.zygote.kill()
        self.zygote.wait(10)


def _last_bucket(train: Path) -> tuple[int, dict[int, int]]:
    """The last bucket's index on every rank of the deployment's plan (each rank cuts alike), and
    for each engine rank the last trainer rank that sends to it in that bucket."""
    plan = compile_plan(load(str(train)), replicate(load(str(INFER)), 3, 2), relay=False)
    counts = {len(schedule(plan, r, BUDGET, False, cut=True).buckets) for r in range(plan.world)}
    assert len(counts) == 1 and counts.pop() >= 6, "the matrix needs >= 6 buckets on every rank"
    last = len(schedule(plan, 0, BUDGET, False, cut=True).buckets) - 1
    senders = {t: max(op.src_rank for op in schedule(plan, 2 + 3 * t, BUDGET, False, cut=True).ops[last])
               for t in range(2)}  # (plan rank 2 + 3t: replica slot 0's rank t; every slot alike)
    return last, senders


def _exact(d: Deployment, rid: str, version: int, index: int) -> None:
    for rank in range(2):
        row = d.lines((rid, rank), index)[index - 1]
        assert "error" not in row, (rid, rank, row["error"])
        assert row["version"] == version and row["problems"] == [], (rid, rank, row)


@pytest.mark.timeout(600)
def test_a_fault_costs_only_its_replica(tmp_path):
    train = tmp_path / "train.layout"  # the examples' trainer on TP2 alone: 2 ranks
    train.write_text((ROOT / "examples" / "jobs" / "train.layout").read_text().replace("arg DP = 2", "arg DP = 1"))
    last = _last_bucket(train)
    (tmp_path / "config.json").write_text(json.dumps({
        "address": f"127.0.0.1:{free_port()}", "train": str(train), "infer": str(INFER), "timeout": TIMEOUT,
        "budget": BUDGET, "shutdown": 2 * TIMEOUT}))
    d = Deployment(tmp_path)
    try:
        _scenario(d, last)
    finally:
        (tmp_path / "stop").touch()
        d.close()


def _scenario(d: Deployment, last_bucket: tuple[int, dict[int, int]]) -> None:
    last, senders = last_bucket
    for rank in range(2):
        d.start(("trainer", rank), "trainer", str(rank))
    receives = {}  # (replica, rank) -> receives its live process has made
    for rid in REPLICAS:
        for rank in range(2):
            d.start((rid, rank), "engine", rid, str(rank), *(["strided"] if rid == "r0" else []))
            receives[(rid, rank)] = 0

    def refit_all(expect=REPLICAS, **extra) -> tuple[int, dict]:
        for who in receives:
            d.until(lambda who=who: d.waiting(who))
        n = d.refit(expect=list(expect), **extra)
        return n, d.report(n)

    def took(report: dict) -> float:
        return report["at"] - report["began"]

    baseline = []
    for _ in range(2):
        n, report = refit_all()
        assert report.get("replicas") == list(REPLICAS), report
        # "auto" (the default): every pair of this deployment shares a host, so shared memory moves it
        assert set(report["transports"]) == set(REPLICAS), report
        assert all(t.startswith("memory (") for t in report["transports"].values()), report
        baseline.append(took(report))
        for rid in REPLICAS:
            for rank in range(2):
                receives[(rid, rank)] += 1
            _exact(d, rid, 10 * n, receives[(rid, 0)])
    baseline = baseline[-1]  # (the first refit plans and connects from cold)

    runs = 0
    for point in [*range(5), "mid"]:
        for run in range(RUNS):
            rid, rank = VICTIMS[runs % len(VICTIMS)]
            runs += 1
            other = (rid, 1 - rank)
            bucket, after = (last, 0.15) if point == "mid" else (point, 0.0)
            (d.where / f"kill-{rid}-{rank}.json").write_text(json.dumps({"refit": d.n + 1, "bucket": bucket,
                                                                          "after": after}))
            # in one run of three the replica's launcher also stops its other rank as that bucket
            # starts (SIGTERM: it leaves its walk and shuts down slowly, alive, its connections open)
            stopped = run == 1
            if stopped:
                (d.where / f"kill-{rid}-{1 - rank}.json").write_text(json.dumps({"refit": d.n + 1, "bucket": bucket,
                                                                                  "after": 0, "stop": True}))
            # mid: the rank dies 0.15 s into the last bucket, its sender there holds its part back 0.6 s
            extra = {"slow": [senders[rank], last, 0.6]} if point == "mid" else {}
            n, report = refit_all(**extra)
            where = f"killed {rid} rank {rank} at bucket {point} of refit {n}"
            assert report.get("missed") == [rid], (where, report)
            assert report["replicas"] == sorted(set(REPLICAS) - {rid}), (where, report)
            assert f"replica {rid}" in report["reasons"][rid], (where, report)
            for trainer_rank in range(2):
                assert took(d.report(n, trainer_rank)) <= TIMEOUT + SLACK, (where, trainer_rank, d.report(n, trainer_rank))
            for survivor in set(REPLICAS) - {rid}:
                for r in range(2):
                    receives[(survivor, r)] += 1
                _exact(d, survivor, 10 * n, receives[(survivor, 0)])
            if stopped:  # (its sibling, stopped as the same bucket starts, may drop the replica before the
                d.kill((rid, rank))  # victim reaches its kill point: it then fails, alive; shared memory is that quick)
            assert d.exit_code(d.pids[(rid, rank)]) == -signal.SIGKILL, where
            if not stopped:  # the rank that survived fails this refit and waits in `receive` again
                row = d.lines(other, receives[other] + 1)[-1]
                assert "error" in row and f"replica {rid} rank {1 - rank}: refit {n}" in row["error"], (where, row)
                d.until(lambda: d.waiting(other))
            d.kill(other)  # (its wait, if it made one, stays in the store)
            # the replica restarts under its id, the killed rank first; the refit that expects it
            # opens before the other rank is up: its predecessor's wait must not count
            d.start((rid, rank), "engine", rid, str(rank))
            for who in [*(w for w in receives if w[0] != rid), (rid, rank)]:
                d.until(lambda who=who: d.waiting(who))
            n = d.refit(expect=list(REPLICAS))
            d.start(other, "engine", rid, str(1 - rank))
            ready = d.until(lambda: d.waiting(other), step=0.002)
            report = d.report(n)
            where = f"the restart of {rid} after refit {n - 1}"
            assert report.get("replicas") == list(REPLICAS), (where, report)
            receives[(rid, 0)] = receives[(rid, 1)] = 0
            for who in receives:
                receives[who] += 1
            for r_id in REPLICAS:
                _exact(d, r_id, 10 * n, receives[(r_id, 0)])
            assert report["at"] - max(report["began"], ready) <= baseline + SLACK, (where, report, ready, baseline)

    # expect= naming a replica that joined but never receives
    d.start(("idle", 0), "engine", "idle", "0", "idle")
    d.start(("idle", 1), "engine", "idle", "1", "idle")
    n, report = refit_all(expect=(*REPLICAS, "idle"))
    assert report.get("replicas") == list(REPLICAS) and report["missed"] == ["idle"], report
    assert "did not wait in receive within" in report["reasons"]["idle"], report
    for trainer_rank in range(2):
        assert took(d.report(n, trainer_rank)) <= TIMEOUT + SLACK, (trainer_rank, d.report(n, trainer_rank))
    for who in receives:
        receives[who] += 1
    for rid in REPLICAS:
        _exact(d, rid, 10 * n, receives[(rid, 0)])

    # quiet: the engines idle in `receive`, then the trainer closes and exits
    for who in receives:
        d.until(lambda who=who: d.waiting(who))
    time.sleep(IDLE)
    d.refit(stop=True)
    for rank in range(2):
        assert d.exit_code(d.pids[("trainer", rank)], 30) == 0, d.logs()
    for who in receives:
        assert d.exit_code(d.pids[who], 30) == 0, (who, d.logs())
        row = d.lines(who, receives[who] + 1)[-1]
        assert "the trainer job closed" in row.get("error", ""), (who, row)
    printed = {who: d.stderr[d.pids[who]].read_text(errors="replace") for who in receives}  # its whole life
    assert not any(printed.values()), {who: text[:400] for who, text in printed.items() if text}
