"""A refit between separately launched jobs (issue 26), on real gloo processes.

One launch carries the whole life of a deployment, each assertion at the step it is about:
a trainer job of 4 processes (its own world) and replicas of 2 processes (each its own
world), the shipped programs of examples/jobs/, meeting only at the store trainer rank 0
hosts. Every destination element of every replica is checked after every refit against
the version that replica reports (examples/jobs/weights.py: each version has its own
values, from the layout's logical coordinates).

    refit 1, 2   replicas r0, r1, r2 (r2 and the trainer pass named_parameters())
    refit 3      r1's rank 1 is SIGKILLed as its bucket 0 starts (every tensor contiguous: one
                 bucket; the trainer's bytes are moving into it)
    refit 4      r1 restarted (a new job, same id), r3 added between refits (its destinations
                 non-contiguous views: every rank of every job cuts its buckets as staged from
                 here on); `odd`, a replica whose layout is TP1, is refused with the reason and
                 the others proceed
    refit 5      every replica
    refit 6      trainer rank 2 is SIGKILLed in its bucket 1 (of 7): every rank of every job raises
"""

import pytest

from jobs_harness import EXAMPLES, Jobs

TIMEOUT = 8.0        # a loaded 2-core CI machine connects 4 replicas' new groups well within it
SLACK = 1.0          # acceptance: within timeout + 1 s
BUDGET = 65536       # 7 buckets on every rank when cut as staged (so bucket 1 is mid-transfer)
TRAINER = 4


@pytest.mark.timeout(420)
def test_trainer_job_feeds_replicas_that_fail_restart_and_join(tmp_path):
    jobs = Jobs(tmp_path, timeout=TIMEOUT)
    try:
        _scenario(jobs)
    finally:
        jobs.close()


def _exact(jobs, rid, refit_index, version, ranks=2):
    for rank in range(ranks):
        row = jobs.lines(rid, rank, refit_index)[refit_index - 1]
        assert "error" not in row, f"replica {rid} rank {rank}: {row['error']}"
        assert row["version"] == version, (rid, rank, row)
        assert row["problems"] == [], (rid, rank, row["problems"][:3])


def _scenario(jobs: Jobs) -> None:
    odd = jobs.tmp / "odd.layout"  # the engine's layout on one rank instead of two
    odd.write_text((EXAMPLES / "infer.layout").read_text().replace("arg TP = 2", "arg TP = 1"))
    jobs.trainer(TRAINER, "--refits", "6", "--budget", str(BUDGET), "--parameters",
                 "--die-refit", "6", "--die-rank", "2")
    jobs.replica("r0", 2)
    jobs.replica("r1", 2, "--die-refit", "3", "--die-rank", "1", "--die-bucket", "0")
    jobs.replica("r2", 2, "--parameters")
    three = {"r0": 2, "r1": 2, "r2": 2}

    for n in (1, 2):
        jobs.wait_waiting(three)
        jobs.step(n)
        report = jobs.report(n)
        assert sorted(report["replicas"]) == ["r0", "r1", "r2"] and report["missed"] == [], report
        for rid in three:
            _exact(jobs, rid, n, 10 * n)
    assert all(jobs.lines("r2", r, 2)[1]["parameters"] for r in range(2))  # still requires_grad, no grad

    # refit 3: r1 rank 1 dies while bytes move; the trainer and the others finish the step
    jobs.wait_waiting(three)
    jobs.step(3)
    report = jobs.report(3)
    assert report["missed"] == ["r1"] and sorted(report["replicas"]) == ["r0", "r2"], report
    assert "replica r1" in report["reasons"]["r1"], report["reasons"]
    assert report["at"] - report["began"] <= TIMEOUT + SLACK, report
    for rid in ("r0", "r2"):
        _exact(jobs, rid, 3, 30)
    survivor = jobs.lines("r1", 0, 3)[2]
    assert "error" in survivor and "replica r1 rank 0: refit 3" in survivor["error"], survivor
    assert survivor["version"] == 20 and survivor["interrupted"] is True, survivor
    assert survivor["at"] - report["began"] <= TIMEOUT + SLACK, (survivor, report)
    assert jobs.procs[("r1", 1)].wait(10) == -9

    # refit 4: r1 restarted as a new job, r3 joins; both get the whole of version 40
    jobs.kill("r1", 0)
    jobs.replica("r1", 2)
    jobs.replica("r3", 2, "--strided")
    jobs.replica("odd", 1, "--infer", str(odd), "--receives", "1")
    four = {**three, "r3": 2}
    jobs.wait_waiting({**four, "odd": 1})
    jobs.step(4)
    report = jobs.report(4)
    assert sorted(report["replicas"]) == ["r0", "r1", "r2", "r3"] and report["missed"] == ["odd"], report
    assert "refused" in report["reasons"]["odd"] and "rank" in report["reasons"]["odd"], report["reasons"]
    refused = jobs.lines("odd", 0, 1)[0]
    assert "replica odd rank 0" in refused["error"] and "refused" in refused["error"], refused
    _exact(jobs, "r0", 4, 40)
    _exact(jobs, "r2", 4, 40)
    _exact(jobs, "r1", 1, 40)  # the restarted job's first receive
    _exact(jobs, "r3", 1, 40)

    jobs.wait_waiting(four)
    jobs.step(5)
    report = jobs.report(5)
    assert sorted(report["replicas"]) == ["r0", "r1", "r2", "r3"], report
    for rid, index in (("r0", 5), ("r1", 2), ("r2", 5), ("r3", 2)):
        _exact(jobs, rid, index, 50)

    # refit 6: a trainer rank dies while bytes move: every rank of every job raises in time
    jobs.wait_waiting(four)
    jobs.step(6)
    errors = jobs.trainer_errors(TRAINER, 6)
    assert sorted(errors) == [0, 1, 3], errors  # rank 2 is dead
    began = min(e["began"] for e in errors.values())
    for rank, e in errors.items():
        assert f"trainer rank {rank}: refit 6" in e["error"], e
        assert "trainer rank 2" in e["error"] or "rank 2" in e["error"], e
        assert e["at"] - began <= TIMEOUT + SLACK, (rank, e["at"] - began)
    for rid, index in (("r0", 6), ("r1", 3), ("r2", 6), ("r3", 3)):
        for rank in range(2):
            row = jobs.lines(rid, rank, index)[index - 1]
            assert "error" in row and f"replica {rid} rank {rank}" in row["error"], (rid, rank, row)
            assert row["version"] == 50, (rid, rank, row)      # what every element still holds
            assert row["at"] - began <= TIMEOUT + SLACK, (rid, rank, row["at"] - began)
    # every program ends by itself once its trainer is gone: nothing hangs
    for key, p in list(jobs.procs.items()):
        p.wait(TIMEOUT + 30)
