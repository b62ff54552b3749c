"""The `layoutlang` trainer through vLLM's own trainer-side clients (docs/engines.md).

vLLM's client protocol (`VLLMWeightSyncClient`) takes the worker's init info and update
payload themselves; `HTTPVLLMWeightSyncClient` wraps them in the body of vLLM's RL routes and
`RayVLLMWeightSyncClient` in vLLM's request objects for an `LLM` actor, and the engine side
unwraps once. Each test drives a tiny Llama and a tiny Qwen3-MoE, built by vLLM's model loader
on CPU, through `WeightTransferTrainerFactory.trainer_init` and three `send_weights`; after
each refit every parameter and buffer equals what vLLM's own `load_weights` writes from the
trainer's checkpoint of that step (tests/vllm_clients_program.py, tests/vllm_hosts.py).
One Ray session serves both Ray tests, one HTTP server both HTTP tests (module fixtures).
Without .venv-vllm they skip on a developer's machine and fail in CI (LAYOUTLANG_CI=1).
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
from test_vllm import _port, _python  # noqa: E402
from vllm_clients_program import wait_gone  # noqa: E402

PROGRAM = ROOT / "tests" / "vllm_clients_program.py"
TIMEOUT = 300
ARCHS = ["llama", "qwen3_moe"]


def _run(*commands: list[str]) -> list[list[dict]]:
    env = dict(os.environ, VLLM_TARGET_DEVICE="cpu", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
               PYTHONUNBUFFERED="1", RAY_AUTH_MODE="disabled", RAY_USAGE_STATS_ENABLED="0")
    return program_runs.run_all(_python(), PROGRAM, list(commands), env=env, cwd=ROOT, timeout=TIMEOUT)


@pytest.fixture(scope="module")
def ray_session():
    """The `ray` program once: one Ray session, both engines in actors, both trainers driven
    through RayVLLMWeightSyncClient. Its processes are gone afterwards: any left (found by the
    session folder, which only this run's processes name) is killed and fails the tests."""
    tmp = tempfile.mkdtemp(prefix="lr-ray-", dir="/tmp")  # short: Ray's socket paths live under it
    try:
        (lines,) = _run(["ray", tmp])
    finally:
        left = wait_gone(tmp)  # the driver is gone too now: anything of the session still alive
        for pid in left:       # is this run's own (its folder is on the command line): ended
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        shutil.rmtree(tmp, ignore_errors=True)
    return lines, left


@pytest.fixture(scope="module")
def http_session():
    """The HTTP server (vLLM's RL router over both engines) and the trainer process, once."""
    port = _port()
    engine, trainer = _run(["http_engine", str(port)], ["http_trainer", str(port)])
    return engine, trainer


def _refits(lines: list[dict], arch: str) -> list[dict]:
    return [x for x in lines if x.get("arch") == arch and "step" in x]


@pytest.mark.parametrize("arch", ARCHS)
def test_ray_client_refits_engines_in_ray_actors(ray_session, arch):
    """RayVLLMWeightSyncClient -> an `LLM`'s RL entry points in a Ray actor -> vLLM's worker
    methods -> the backend: three refits, each equal to vLLM's own load of that step; the
    committed weight version is the step's; the Ray session leaves no process behind."""
    lines, left = ray_session
    steps = _refits(lines, arch)
    assert [x["step"] for x in steps] == [1, 2, 3]
    assert all(x["client"] == "RayVLLMWeightSyncClient" for x in steps)
    assert all(x["differ"] == [] and x["moved_storage"] == [] for x in steps), steps
    assert [(x["version"], x["weight_version"]) for x in steps] == [(1, "1"), (2, "2"), (3, "3")]
    assert [x["replicas"] for x in steps] == [["vllm-0"]] * 3
    up = next(x for x in lines if x.get("ray") == "up")
    assert len(set(up["actor_pids"])) == 2 and up["driver_pid"] not in up["actor_pids"]  # other processes
    down = next(x for x in lines if x.get("ray") == "down")
    assert down["left"] == [], f"Ray processes alive after ray.shutdown(): {down['left']}"
    assert left == [], f"Ray processes alive after the driver exited (killed now): {left}"


@pytest.mark.parametrize("arch", ARCHS)
def test_http_client_refits_through_vllms_rl_routes(http_session, arch):
    """HTTPVLLMWeightSyncClient -> vLLM's RL router (`/init_weight_transfer_engine`,
    `/start_weight_update`, `/update_weights`, `/finish_weight_update`) -> AsyncLLM's methods ->
    vLLM's worker methods -> the backend, in another process: three refits, each equal to
    vLLM's own load of that step; `/weight_info` then says "3"."""
    engine, trainer = http_session
    steps = _refits(trainer, arch)
    assert [x["step"] for x in steps] == [1, 2, 3]
    assert all(x["client"] == "HTTPVLLMWeightSyncClient" for x in steps)
    assert all(x["differ"] == [] and x["moved_storage"] == [] for x in steps), steps
    assert [(x["version"], x["weight_version"]) for x in steps] == [(1, "1"), (2, "2"), (3, "3")]
    assert [x["replicas"] for x in steps] == [["vllm-0"]] * 3
    assert next(x for x in trainer if x.get("arch") == arch and "weight_info" in x)["weight_info"] == \
        {"weight_version": "3"}
    # the worker saw vLLM's calls in vLLM's order, once each per step
    assert engine[-1]["calls"][arch] == ["init_weight_transfer_engine"] + \
        ["start_weight_update", "update_weights", "finish_weight_update"] * 3 + ["shutdown_weight_transfer_engine"]


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
