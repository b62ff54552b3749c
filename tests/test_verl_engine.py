"""The `layoutlang` verl checkpoint engine (layoutlang/integrations/verl.py) on real Ray 2.60 and verl 0.9.1.

One run of tests/verl_program.py (one Ray session, one deployment: 2 FSDP2 trainer actors, 2
rollout replicas of TP2, verl's own CheckpointEngineManager driving 3 updates of a tiny Qwen3
and of a tiny Qwen3-MoE) feeds every assertion below. Expected values come from torch's
`full_tensor()` of the trainer and vLLM's storage rules written out in the program.
"""

from __future__ import annotations

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

PROGRAM = ROOT / "tests" / "verl_program.py"
TIMEOUT = 240

needed = ("ray", "verl", "transformers")
missing = [m for m in needed if not __import__("importlib").util.find_spec(m)]
if missing and os.environ.get("LAYOUTLANG_CI") != "1":
    pytest.skip(f"not installed: {', '.join(missing)} (bash scripts/setup.sh installs them)", allow_module_level=True)


@pytest.fixture(scope="module")
def run():
    import verl_program

    tmp = tempfile.mkdtemp(prefix="lv-ray-", dir="/tmp")  # short: Ray's socket paths live under it
    env = dict(os.environ, PYTHONUNBUFFERED="1", RAY_AUTH_MODE="disabled", RAY_USAGE_STATS_ENABLED="0",
               HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    try:
        (lines,) = program_runs.run_all(sys.executable, PROGRAM, [[tmp, "--bench"]], env=env, cwd=ROOT,
                                        timeout=TIMEOUT)
    finally:
        for pid in verl_program.wait_gone(tmp, 5.0):  # this run's own (its folder is on their command line)
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        shutil.rmtree(tmp, ignore_errors=True)
    return lines


def _steps(lines, arch):
    return [x for x in lines if x.get("arch") == arch and "step" in x]


def test_backend_comes_from_verls_registry_by_the_configured_name(run):
    (backend,) = [x["backend"] for x in run if "backend" in x]
    assert backend == "layoutlang.integrations.verl.LayoutlangCheckpointEngine"


@pytest.mark.parametrize("arch", ["qwen3", "qwen3_moe"])
def test_three_updates_exact_in_every_rollout_rank(run, arch):
    steps = _steps(run, arch)
    assert [x["step"] for x in steps] == [1, 2, 3]
    for x in steps:
        assert len(x["checks"]) == 4  # 2 replicas x TP2
        assert [(c["replica"], c["rank"]) for c in x["checks"]] == [("replica-0", 0), ("replica-0", 1),
                                                                    ("replica-1", 0), ("replica-1", 1)]
        for c in x["checks"]:
            assert c["bad"] == [], f"step {x['step']}: rank {c['rank']} differs in {c['bad'][:5]}"
            assert c["elements"] > 0
            assert c["version"] == x["step"]  # verl's global_steps is the weight version


@pytest.mark.parametrize("arch", ["qwen3", "qwen3_moe"])
def test_verls_partial_rollout_hooks_run_around_each_update(run, arch):
    for x in _steps(run, arch):
        assert x["hooks"] == ["abort"] * 2 + ["release_kv_cache"] * 2 + ["resume_kv_cache"] * 2 + \
            ["resume_generation"] * 2
        assert x["metrics"]["layoutlang/replicas"] == 2


@pytest.mark.parametrize("arch", ["qwen3", "qwen3_moe"])
def test_no_actor_gathers_and_allocations_stay_within_the_budget(run, arch):
    for x in _steps(run, arch):
        for t in x["trainers"]:
            assert t["gathers"] == []
            # peak bytes allocated during the refit on top of the shards it holds anyway
            assert t["peak"] <= t["budget"], t
            assert t["sent"] > 0
        for c in x["checks"]:
            assert c["gathers"] == []
            assert c["peak"] <= c["budget"], c


@pytest.mark.parametrize("arch", ["qwen3", "qwen3_moe"])
def test_every_trainer_sends_its_fair_share_where_the_nccl_path_sends_all_from_rank_0(run, arch):
    (bench,) = [x for x in run if x.get("arch") == arch and x.get("bench")]
    assert bench["layoutlang_ratio"] < 1.2, bench
    assert bench["standin_ratio"] == 2.0, bench  # rank 0 of 2 sends every byte
    # the meter sees a gather: the stand-in's peak holds the largest full tensor
    assert bench["standin_peak"] >= 8192 * 64 * 4, bench


def test_ray_session_leaves_no_process(run):
    (down,) = [x for x in run if x.get("ray") == "down"]
    assert down["left"] == []


# ---- without Ray: the topology and the refusals, through verl's registry ----------------------------

def _engine(**kwargs):
    from verl.checkpoint_engine import CheckpointEngineRegistry
    from verl.utils.import_utils import import_external_libs

    import_external_libs("layoutlang.integrations.verl")  # what verl does with custom_backend_module
    return CheckpointEngineRegistry.new("layoutlang", bucket_size=1 << 20, **kwargs)


def _metadata(ranks=(0, 1, 0, 1), layout="L", replicas=(None,) * 4):
    actors = [{"role": "trainer", "address": "10.0.0.1:4000", "prefix": "rollout"},
              {"role": "trainer", "address": None, "prefix": "rollout"}]
    return actors + [{"role": "rollout", "layout": layout, "ranks": 2, "rank": t, "replica": r}
                     for t, r in zip(ranks, replicas)]


def test_build_topology_places_replica_i_rank_t_at_plan_rank_n_plus_t_k_plus_i():
    cls = type(_engine())
    actor, rollout = cls.build_topology(2, 4, _metadata())
    assert actor["rank"] == [0, 1] and actor["world_size"] == [2, 2]
    assert actor["replicas"] == [["rollout-0", "rollout-1"]] * 2
    assert actor["address"] == ["10.0.0.1:4000"] * 2 and actor["infer"] == ["L", "L"]
    assert rollout["replica"] == ["rollout-0", "rollout-0", "rollout-1", "rollout-1"]
    assert rollout["rank"] == [0, 1, 0, 1] and rollout["world_size"] == [2] * 4
    # N=2 trainer ranks, K=2 replicas: replica i's rank t is plan rank 2 + 2t + i (docs/jobs.md)
    assert rollout["plan_rank"] == [2, 4, 3, 5]
    _, named = cls.build_topology(2, 4, _metadata(replicas=("r7", "r7", "r3", "r3")))  # the workers' own ids
    assert named["replica"] == ["r7", "r7", "r3", "r3"]


@pytest.mark.parametrize("case, message", [
    ("unbound", "rollout worker 1 has no parameters bound: call engine.bind_rollout(model, layout)"),
    ("ranks", "rollout workers 0..1 (replica 0) are ranks [1, 1] of their replicas"),
    ("layouts", "rollout worker 3 holds another layout than worker 0"),
    ("stores", "0 actor workers host a store; exactly one"),
    ("count", "3 rollout workers do not form replicas of 2 ranks"),
    ("ids", "rollout workers 2..3 (replica 1) name different replica ids ['a', 'b']"),
    ("same", "replica ids ['a', 'a'] repeat"),
])
def test_build_topology_refuses_what_cannot_be_planned(case, message):
    from layoutlang.integrations.verl import VerlEngineError

    meta = _metadata()
    if case == "unbound":
        meta[3] = {"role": "trainer", "address": None}
    elif case == "ranks":
        meta[2]["rank"] = 1
    elif case == "layouts":
        meta[5]["layout"] = "M"
    elif case == "stores":
        meta[0]["address"] = None
    elif case == "ids":
        meta[4]["replica"], meta[5]["replica"] = "a", "b"
    elif case == "same":
        meta = _metadata(replicas=("a",) * 4)
    else:
        del meta[5]
    with pytest.raises(VerlEngineError) as err:
        type(_engine()).build_topology(2, len(meta) - 2, meta)
    assert message in str(err.value)


def test_bind_rollout_refuses_parameters_that_are_not_the_layout():
    import torch

    from layoutlang.integrations.verl import VerlEngineError

    engine = _engine()
    with pytest.raises(VerlEngineError) as err:
        engine.bind_rollout({"w": torch.zeros(2, 3)}, "mesh e (tp=2)\ntensor w [4 over tp, 2] fp32\n", rank=1)
    assert "`w`: the layout says [2, 2] fp32, the rollout holds [2, 3] float32" in str(err.value)


def test_send_weights_never_reads_verls_full_tensor_generator():
    import asyncio

    from layoutlang.integrations.verl import VerlEngineError

    read = []

    def per_tensor_param():  # what get_per_tensor_param() returns: iterating it gathers
        read.append("gathered")
        yield "w", None

    gen = per_tensor_param()
    with pytest.raises(VerlEngineError) as err:
        asyncio.run(_engine(is_master=False).send_weights(gen, global_steps=1))
    assert "pass the training engine" in str(err.value)
    assert read == [] and gen.gi_frame is None  # closed unread


def test_verls_actor_worker_hands_its_training_engine_to_the_layoutlang_backend():
    """verl's own ActorRolloutRefWorker.update_weights, as the hook leaves it: the training
    engine reaches send_weights; get_per_tensor_param (a gather) is never called."""
    import asyncio
    from types import SimpleNamespace

    import torch
    from verl.single_controller.base.decorator import MAGIC_ATTR, Dispatch
    from verl.workers import engine_workers

    from layoutlang.integrations.verl import VerlEngineError, patch_actor_worker

    patch_actor_worker()  # (applied at the hook's import where engine_workers was loaded first)
    cls = engine_workers.ActorRolloutRefWorker
    assert getattr(cls.update_weights, MAGIC_ATTR)["dispatch_mode"] == Dispatch.ONE_TO_ALL  # verl still dispatches it

    class TrainingEngine:
        module = torch.nn.Linear(2, 2)

        def get_per_tensor_param(self, **kwargs):
            raise AssertionError("verl's gathering path was taken")

    worker = object.__new__(cls)
    worker.checkpoint_engine = _engine(is_master=False)
    worker.actor = SimpleNamespace(engine=TrainingEngine())
    with pytest.raises(VerlEngineError) as err:  # no topology yet: it stops right after taking the module
        asyncio.run(cls.update_weights(worker, global_steps=1))
    assert "send_weights before init_process_group" in str(err.value)
    assert worker.checkpoint_engine.module is TrainingEngine.module
