"""Engine replicas whose layouts differ in their args (an EPLB map each: layoutlang/runtime/jobs.py
`ReplicaPlans`, `EngineJob.set_args`), one trainer job feeding them, in one process.

The trainer (2 ranks, EP2 over 4 logical experts) and two replicas of 2 ranks (EP2 over 6
physical slots, slot p of layer l holding expert MAP[l][p]) are threads around one
HashStore; bytes move through each replica's own gloo group as between real jobs. The
oracle is layoutlang/runtime/fill.py: every element's value is a function of its logical key and index,
so each destination element is checked from the replica's own layout of that map alone
(no source, no plan): a slot filled with the wrong expert shows as wrong values.

    refit 1   A holds map M1, B map M2: two layouts, planned and walked one after the other
    refit 2   A rebalances to M3 (set_args between receives): A's plan re-keyed by TablePlanner
    refit 3   A rebalances to M2, B's map: one layout, one plan of two copies
    refit 4   B's rank 0 publishes M3 while its rank 1 keeps M2 (a replica out of step with
              itself): the trainer plans M3 for B, B's rank 1 refuses that plan before a byte
              lands, B misses the step, A takes it
"""

from __future__ import annotations

import threading
from datetime import timedelta

import pytest
import torch.distributed as dist

from layoutlang import loads
from layoutlang.compiler.members import MemberPlanner
from layoutlang.runtime import EngineJob, RefitError, TrainerJob
from layoutlang.runtime.fill import check_destination, empty_destination, source_tensor

L, E, P = 2, 4, 6
TRAINER = f"""mesh t (ep=2)
tensor emb [64, 16]
for l in 0..{L} {{
  for e in 0..{E} over ep {{
    tensor fc1.{{l}}.{{e.local}} as l.{{l}}.e.{{e}}.fc1 [8, 16] on t
    tensor fc2.{{l}}.{{e.local}} as l.{{l}}.e.{{e}}.fc2 [16, 8] on t
  }}
}}
"""
M1 = [[0, 1, 2, 3, 0, 1], [0, 1, 2, 3, 0, 1]]
M2 = [[3, 2, 1, 0, 3, 3], [1, 0, 2, 2, 3, 0]]
M3 = [[2, 2, 0, 1, 3, 1], [3, 1, 0, 2, 1, 3]]
ENGINE = f"""arg MAP = {M1}
mesh x (ep=2)
tensor emb [64, 16]
for l in 0..{L} {{
  tensor w1.{{l}} as l.{{l}}.e.{{MAP[l][p]}}.fc1 [p in 0..{P} over ep, 8, 16]
  tensor w2.{{l}} as l.{{l}}.e.{{MAP[l][p]}}.fc2 [p in 0..{P} over ep, 16, 8]
}}
"""
TIMEOUT = 10.0


def _run(fns: list) -> list:
    """Each fn in its own thread; their results (or exceptions) in order."""
    out: list = [None] * len(fns)

    def call(i, fn):
        try:
            out[i] = fn()
        except BaseException as exc:  # noqa: BLE001 - returned to the test
            out[i] = exc

    threads = [threading.Thread(target=call, args=(i, fn), daemon=True) for i, fn in enumerate(fns)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(TIMEOUT * 3)
    assert not any(t.is_alive() for t in threads), "a job thread did not finish"
    return out


def _problems(layout, rank: int, tensors) -> list[str]:
    return [p for t in layout.tensors if t.holds(rank) and (p := check_destination(t, rank, tensors[t.name]))]


@pytest.mark.timeout(240)
def test_replicas_with_their_own_maps_refit_exactly_and_rebalance():
    src = loads(TRAINER, "trainer.layout")
    store = dist.HashStore()
    kw = dict(store=store, timeout=timedelta(seconds=TIMEOUT))
    trainers = _run([lambda r=r: TrainerJob(src, loads(ENGINE, "engine.layout"), rank=r, world_size=2, **kw)
                     for r in range(2)])
    sources = [{t.name: source_tensor(t, r) for t in src.tensors if t.holds(r)} for r in range(2)]
    engines = {rid: [EngineJob(loads(ENGINE, "engine.layout", {"MAP": m}), replica=rid, rank=r, world_size=2, **kw)
                     for r in range(2)] for rid, m in (("A", M1), ("B", M2))}
    held = {rid: [{t.name: empty_destination(t, rank=r) for t in jobs[r].one.tensors if t.holds(r)}
                  for r in range(2)] for rid, jobs in engines.items()}

    def refit():
        """Every rank of every job at once; (trainer rank 0's report, each engine rank's result)."""
        fns = [lambda r=r: trainers[r].refit(sources[r], n, expect=("A", "B")) for r in range(2)]
        fns += [lambda j=j, t=t: j.receive(t) for rid in engines for j, t in zip(engines[rid], held[rid])]
        out = _run(fns)
        assert not isinstance(out[0], BaseException), out[0]
        return out[0], dict(zip([(rid, r) for rid in engines for r in range(2)], out[2:]))

    try:
        for n, rebalance in ((1, {}), (2, {"A": M3}), (3, {"A": M2})):
            for rid, m in rebalance.items():
                for job in engines[rid]:
                    job.set_args({"MAP": m})
            report, got = refit()
            assert sorted(report.replicas) == ["A", "B"] and report.missed == (), report
            for (rid, r), version in got.items():
                assert version == n, (rid, r, version)
                layout = engines[rid][r].one
                assert _problems(layout, r, held[rid][r]) == [], (n, rid, r)
                # the slots hold the experts the map names, read off the layout the job holds
                w1 = {t.name: t for t in layout.tensors}["w1.1"]
                assert [k.key for k in w1.regions] == [f"l.1.e.{e}.fc1" for e in dict(layout.args)["MAP"][1]]
        assert dict(engines["A"][0].one.args)["MAP"] == tuple(map(tuple, M2))
        # A's new maps (one copy, one table arg changed) went through TablePlanner's re-keying, and
        # its plans are the member planner's of a fresh load of each map (the independent path)
        assert set(trainers[0].plans.tables) == {"MAP"}
        for m in (M2, M3):
            kept = trainers[0].plans.plan(1, {"MAP": m})
            fresh = MemberPlanner(src, loads(ENGINE, "engine.layout", {"MAP": m})).plan(1)
            assert kept.digest == fresh.digest and kept.ops == fresh.ops

        # refit 4: B's ranks disagree on its map; its rank 0's layout is what the trainer plans for
        engines["B"][0].set_args({"MAP": M3})
        n = 4
        report, got = refit()
        assert report.replicas == ("A",) and report.missed == ("B",), report
        assert isinstance(got[("B", 1)], RefitError) and "its args changed" in str(got[("B", 1)]), got[("B", 1)]
        assert got[("A", 0)] == got[("A", 1)] == 4
        assert engines["B"][1].version == 3  # nothing landed on the rank that refused
    finally:
        for job in trainers:
            if isinstance(job, TrainerJob):
                job.close()
        for jobs in engines.values():
            for job in jobs:
                job.close()
