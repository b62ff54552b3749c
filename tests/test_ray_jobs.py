"""`RayTrainerJob` / `RayEngineJob` in Ray actors: the deployment of examples/ray/ (issue 51).

One Ray session (tests/ray_jobs_program.py, run once for the module) carries every
assertion: examples/ray/deploy.py's trainer of 2 actors (FSDP2 on gloo) refits 3 replicas of
2 actors each, every step; at step 2 rollout-1's rank 1 is `ray.kill`ed (no_restart=False)
as its bucket 1 starts and Ray restarts it. Every engine rank checks every element it holds
after every receive against the version it reports (layoutlang/runtime/fill.py: values from
the key and the logical index, nothing from the plan). The same session then checks the job
name's refusals from the driver. Without Ray the session tests skip on a developer's machine
and fail in CI (LAYOUTLANG_CI=1).
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import signal
import sys
import tempfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
import program_runs  # noqa: E402
from ray_jobs_program import TIMEOUT, wait_gone  # noqa: E402

from layoutlang import load  # noqa: E402
from layoutlang.diagnostics import UsageError  # noqa: E402

PROGRAM = ROOT / "tests" / "ray_jobs_program.py"
REPLICAS = ["rollout-0", "rollout-1", "rollout-2"]
KILLED, KILL_STEP = ("rollout-1", 1), 2
SLACK = 1.0   # acceptance: the trainer's step returns within timeout + 1 s


def _need_ray() -> None:
    if importlib.util.find_spec("ray") is None:
        if os.environ.get("LAYOUTLANG_CI"):
            pytest.fail("ray is not installed in .venv: scripts/setup.sh installs it (the `ray` extra)")
        pytest.skip("ray is not installed (pip install 'layoutlang[ray]')")


@pytest.fixture(scope="module")
def session():
    """The program once; its lines, and the session's processes left after it exited."""
    _need_ray()
    tmp = tempfile.mkdtemp(prefix="lr-rayjobs-", dir="/tmp")  # short: Ray's socket paths live under it
    env = dict(os.environ, PYTHONUNBUFFERED="1", RAY_AUTH_MODE="disabled", RAY_USAGE_STATS_ENABLED="0")
    try:
        (lines,) = program_runs.run_all(sys.executable, PROGRAM, [[tmp]], env=env, cwd=ROOT, timeout=240)
    finally:
        left = wait_gone(tmp)
        for pid in left:  # this run's own (its folder is on their command line): ended
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        shutil.rmtree(tmp, ignore_errors=True)
    return lines, left


def _steps(lines) -> dict[int, dict]:
    return {x["step"]: x for x in lines if "step" in x}


def _row(step: dict, rid: str, rank: int) -> dict:
    rows = [r for r in step["rows"] if r.get("replica") == rid and r.get("rank") == rank]
    assert len(rows) == 1, (rid, rank, step["rows"])
    return rows[0]


def _elements(rank: int) -> int:
    """Every element an engine rank holds, from infer.layout alone (what its check must cover)."""
    layout = load(ROOT / "examples" / "ray" / "infer.layout")
    total = 0
    for t in layout.tensors:
        if t.holds(rank):
            n = 1
            for extent in t.local_shape_at(rank):
                n *= extent
            total += n
    return total


def test_three_refits_exact_across_two_trainer_actors_and_three_replicas(session):
    """Steps 1 and 3: both trainer actors report every replica refit; every element of every
    rank of every replica holds that step's version. Step 2: the replicas not killed, too."""
    lines, _ = session
    steps = _steps(lines)
    assert sorted(steps) == [1, 2, 3]
    for n, step in steps.items():
        assert len(step["reports"]) == 2, step["reports"]  # one per trainer actor, the same verdict
        for report in step["reports"]:
            assert report["refit"] == n and report["version"] == n, report
            hit = [KILLED[0]] if n == KILL_STEP else []
            assert sorted(report["replicas"]) == [r for r in REPLICAS if r not in hit], report
        for rid in REPLICAS:
            if n == KILL_STEP and rid == KILLED[0]:
                continue
            for rank in range(2):
                row = _row(step, rid, rank)
                assert "error" not in row, row
                assert row["version"] == n and row["exact"] is True, row
                assert row["checked"] == _elements(rank), row


def test_the_killed_replica_alone_is_missed_within_timeout(session):
    """Step 2: `ray.kill` of rollout-1's rank 1 while bytes move. The trainer's step returns
    within timeout + 1 s with rollout-1 the only missed replica, its reason naming that rank;
    rollout-1's other rank raises (its tensors interrupted, version 1 still what it reports)."""
    lines, _ = session
    step = _steps(lines)[KILL_STEP]
    assert step["killed"] == "rollout-1/1", step["killed"]
    for report in step["reports"]:
        assert report["missed"] == ["rollout-1"], report
        assert "replica rollout-1 rank 1" in report["reasons"]["rollout-1"], report["reasons"]
        assert report["seconds"] <= TIMEOUT + SLACK, report
    assert "died" in _row(step, *KILLED), _row(step, *KILLED)  # its receive: the actor died in it
    survivor = _row(step, "rollout-1", 0)
    assert "replica rollout-1 rank 0: refit 2" in survivor["error"], survivor
    assert survivor["version"] == 1 and survivor["interrupted"] is True, survivor


def test_an_actor_ray_restarts_rejoins_under_its_replica_id(session):
    """The killed actor, restarted by Ray in a new process (its constructor again: the same
    replica id, a new incarnation), is a member of step 3 and exact there."""
    lines, _ = session
    first = next(x for x in lines if "engines" in x)["engines"]["rollout-1/1"]
    steps = _steps(lines)
    restarted = steps[KILL_STEP]["restarted_pid"]
    assert restarted is not None and restarted != first, (first, restarted)
    row = _row(steps[KILL_STEP + 1], *KILLED)
    assert row["pid"] == restarted and row["version"] == KILL_STEP + 1 and row["exact"] is True, row
    assert all("rollout-1" in r["replicas"] for r in steps[KILL_STEP + 1]["reports"])


def test_every_rank_publishes_its_ray_node(session):
    """The job's store holds each rank's Ray node id (read by trainer rank 0 through
    `node_of`), equal to what each actor's own runtime context says, the restarted one's too."""
    lines, _ = session
    nodes = next(x for x in lines if "nodes" in x)["nodes"]
    trainer = next(x for x in lines if "trainer" in x)["trainer"]
    assert nodes["trainer"] == [t["node_id"] for t in sorted(trainer, key=lambda t: t["rank"])]
    last = _steps(lines)[3]
    for rid in REPLICAS:
        assert nodes[rid] == [_row(last, rid, t)["node_id"] for t in range(2)], (rid, nodes)
    assert all(isinstance(n, str) and len(n) == 56 for n in nodes["trainer"])  # Ray's hex node ids


def test_the_job_name_is_waited_for_refused_when_taken_and_given_back(session):
    """From the driver, in the same session: a name nobody publishes fails at the connect
    timeout (1 s), naming the job; a second live trainer job under a name is refused, naming
    it; once the first closes, the name is free."""
    lines, left = session
    missing = next(x for x in lines if "missing" in x)
    assert "no trainer job named 'nobody-publishes-this'" in missing["missing"], missing
    assert "replica r0 rank 0" in missing["missing"] and missing["phase"] == "setup", missing
    assert 1.0 <= missing["seconds"] <= 1.0 + SLACK, missing
    taken = next(x for x in lines if "taken" in x)["taken"]
    assert "a trainer job named 'taken-name' already runs in this Ray cluster" in taken, taken
    assert "(its store at " in taken, taken  # the live job's own record, read from its name
    retaken = next(x for x in lines if "retaken" in x)
    assert retaken["retaken"] is True and retaken["own"] == retaken["node_id"], retaken
    down = next(x for x in lines if x.get("ray") == "down")
    assert down["left"] == [] and left == [], (down, left)


def test_without_ray_or_a_name_a_usage_error(monkeypatch):
    """No Ray: a UsageError that says how to install it; neither name nor address, or a name
    that is not an id: a UsageError before Ray is touched."""
    from layoutlang.integrations.ray import RayEngineJob, RayTrainerJob

    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` raises ImportError
    one = ROOT / "examples" / "ray" / "infer.layout"
    with pytest.raises(UsageError) as err:
        RayEngineJob(one, name="policy", replica="r0", rank=0, world_size=2)
    assert "needs Ray" in str(err.value) and "pip install 'layoutlang[ray]'" in str(err.value)
    with pytest.raises(UsageError, match="name= .* or address="):
        RayTrainerJob(one, one, rank=0, world_size=2)
    with pytest.raises(UsageError, match="job name 'a b'"):
        RayEngineJob(one, name="a b", replica="r0", rank=0, world_size=2)
