"""The `layoutlang` trainer through vLLM's own trainer-side clients, run under .venv-vllm/bin/python
by tests/test_vllm_clients.py.

    vllm_clients_program.py ray TMP          # RayVLLMWeightSyncClient: engines in Ray actors
    vllm_clients_program.py http_engine PORT # vLLM's RL routes (api_router) over two engines
    vllm_clients_program.py http_trainer PORT  # HTTPVLLMWeightSyncClient against those routes

Each drives a tiny Llama and a tiny Qwen3-MoE (tests/vllm_models.py, built by vLLM's model
loader at TP1) through `WeightTransferTrainerFactory.trainer_init(LayoutlangTrainerInitInfo,
client=...)` and three `send_weights`; the engine side is vLLM's code from the client's
request to the backend (tests/vllm_hosts.py): an `LLM`'s RL entry points in a Ray actor, or
vLLM's RL HTTP router calling `AsyncLLM`'s. After each refit the engine compares every
parameter and buffer with what vLLM's own `load_weights` writes from that step's checkpoint
(the HF checkpoint of seed STEP, made again where it is checked). Every line printed is
JSON; the last is {"ok": true, ...} or the program exits 1.

`ray`: one Ray session (`ray.init(num_cpus=2)` in TMP, RAY_AUTH_MODE=disabled), one actor
per model, shut down at the end; the test then checks that no process of the session is left.
`http_engine` serves both engines from one uvicorn server, vLLM's router mounted once per
engine (`/llama/...`, `/qwen3_moe/...`), until the trainer posts `/quit`.
"""

from __future__ import annotations

import os
import socket
import sys
import tempfile
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import vllm_models as vm  # noqa: E402

vm.setup_env()
import vllm_program as vp  # noqa: E402
from vllm_program import say  # noqa: E402

ARCHS = ("llama", "qwen3_moe")
WAIT = 120.0  # seconds for the HTTP server to come up (it builds four models first)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def session_processes(tmp: str) -> list[int]:
    """Every live process of the Ray session in folder `tmp` but this one: its GCS, raylet and
    workers all name the session's folder, which is the test's own, on their command line."""
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            try:
                if tmp.encode() in (entry / "cmdline").read_bytes():
                    pids.append(int(entry.name))
            except OSError:
                continue
    return pids


def wait_gone(tmp: str, seconds: float = 20.0) -> list[int]:
    """The session's processes still alive after up to `seconds` (they exit on their own)."""
    deadline = time.monotonic() + seconds
    while (left := session_processes(tmp)) and time.monotonic() < deadline:
        time.sleep(0.5)
    return left


def trainer_for(arch: str, client, tmp: Path):
    """vLLM's trainer factory: the `layoutlang` trainer of `arch` (an HF checkpoint layout into the
    engine's), hosting its job's store on a free port, driving the engine through `client`."""
    from vllm.distributed.weight_transfer import WeightTransferTrainerFactory
    from vllm.plugins import load_general_plugins

    from layoutlang.integrations.vllm_engine import LayoutlangTrainerInitInfo

    load_general_plugins()  # the entry point registers the backend, as in any process vLLM runs in
    cfg = vp.ARCHS[arch]
    train = tmp / f"{arch}-hf.layout"
    train.write_text(vp.hf_text(cfg))
    info = LayoutlangTrainerInitInfo(train=str(train), infer=vp.engine_text(cfg), address=f"127.0.0.1:{free_port()}",
                                     world_size=1, replica=vp.REPLICA, timeout=vp.TIMEOUT, rank=0)
    return WeightTransferTrainerFactory.trainer_init(info, client=client)


def refits(arch: str, client, tmp: Path, check) -> bool:
    """Three refits of `arch` through `client`; `check(step)` is the engine's comparison."""
    trainer = trainer_for(arch, client, tmp)
    ok = True
    for step in range(1, vp.STEPS + 1):
        report = trainer.send_weights(vp.checkpoint(vp.ARCHS[arch], step), step)
        seen = check(step)
        say(client=type(client).__name__, replicas=list(report.replicas), **seen)
        ok &= (seen["differ"] == [] and seen["moved_storage"] == [] and seen["version"] == step
               and seen["weight_version"] == str(step) and list(report.replicas) == [vp.REPLICA])
    client.shutdown_weight_transfer_engine()  # the engine leaves the job before its store closes
    trainer.shutdown()
    return ok


def run_ray(tmp: str) -> None:
    """Both engines in Ray actors (the actor: an `LLM`'s RL entry points over one worker),
    each driven through vLLM's RayVLLMWeightSyncClient by a trainer in this process."""
    import ray
    from vllm.distributed.weight_transfer import RayVLLMWeightSyncClient

    import vllm_hosts

    @ray.remote(num_cpus=1)
    class Engine:
        """An engine host whose actor methods are vLLM's `LLM` RL entry points."""

        def __init__(self, arch: str, tmp: str) -> None:
            self.host = vllm_hosts.EngineHost(arch, tmp)
            self.llm = self.host.llm()

        def init_weight_transfer_engine(self, request):
            return self.llm.init_weight_transfer_engine(request)

        def shutdown_weight_transfer_engine(self):
            return self.llm.shutdown_weight_transfer_engine()

        def start_weight_update(self):
            return self.llm.start_weight_update()

        def update_weights(self, request):
            return self.llm.update_weights(request)

        def finish_weight_update(self, weight_version=None):
            return self.llm.finish_weight_update(weight_version)

        def update_weight_version(self, version):
            return self.llm.update_weight_version(version)

        def check(self, step: int) -> dict:
            return self.host.check(step)

        def pid(self) -> int:
            return os.getpid()

    # the actors' processes inherit this environment: vLLM on CPU, tests/ importable
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(Path(__file__).parent), os.environ.get("PYTHONPATH"))
                                               if p)
    ray.init(num_cpus=2, _temp_dir=tmp, include_dashboard=False, log_to_driver=False)
    ok = False
    try:
        engines = {arch: Engine.remote(arch, str(Path(tmp) / "models")) for arch in ARCHS}
        say(ray="up", actor_pids=ray.get([e.pid.remote() for e in engines.values()]), driver_pid=os.getpid())
        ok = all([refits(arch, RayVLLMWeightSyncClient(engine), Path(tmp),
                         lambda step, engine=engine: ray.get(engine.check.remote(step)))
                  for arch, engine in engines.items()])
    finally:
        ray.shutdown()
    # ray.shutdown() ends the session's processes while this driver lives (were it skipped,
    # they would outlive nothing but this driver: Ray ends them when it exits)
    left = wait_gone(tmp)
    say(ray="down", left=left)
    say(ok=ok and not left, role="ray")


def checker(host):
    def layoutlang_check(step: int) -> dict:
        return host.check(step)
    return layoutlang_check


def run_http_engine(port: int) -> None:
    """One uvicorn server: per engine, vLLM's RL router (`register_rl_api_routers`, as `vllm
    serve` mounts it) on an app whose `state.engine_client` has AsyncLLM's methods, mounted at
    `/ARCH`, plus a test route `/ARCH/layoutlang_check?step=N` (the engine's comparison). Serves
    until POST `/quit`."""
    import uvicorn
    from fastapi import FastAPI
    from vllm.entrypoints.rl.factories import register_rl_api_routers

    import vllm_hosts

    tmp = Path(tempfile.mkdtemp())
    root = FastAPI()
    hosts = {}
    for arch in ("qwen3_moe", "llama"):  # the process's vLLM world first set up for the MoE model
        hosts[arch] = host = vllm_hosts.EngineHost(arch, str(tmp))
        app = FastAPI()
        app.state.engine_client = host.engine_client()
        register_rl_api_routers(app)
        app.add_api_route("/layoutlang_check", checker(host), methods=["GET"])
        root.mount(f"/{arch}", app)
    server = uvicorn.Server(uvicorn.Config(root, host="127.0.0.1", port=port, log_level="warning"))

    def quit_() -> dict:
        server.should_exit = True
        return {"quit": True}
    root.add_api_route("/quit", quit_, methods=["POST"])
    say(role="http_engine", phase="serving", port=port)
    server.run()
    say(ok=True, role="http_engine", calls={arch: h.core.calls for arch, h in hosts.items()})


def run_http_trainer(port: int) -> None:
    """Each engine through vLLM's HTTPVLLMWeightSyncClient at `http://127.0.0.1:PORT/ARCH`."""
    import requests
    from vllm.distributed.weight_transfer import HTTPVLLMWeightSyncClient

    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + WAIT
    while True:  # vLLM's /weight_info route answers once the server is up
        try:
            requests.get(f"{base}/llama/weight_info", timeout=5).raise_for_status()
            break
        except requests.RequestException:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.5)
    tmp = Path(tempfile.mkdtemp())
    ok = True
    try:
        for arch in ARCHS:
            def check(step, arch=arch):
                seen = requests.get(f"{base}/{arch}/layoutlang_check", params={"step": step}, timeout=vp.TIMEOUT)
                seen.raise_for_status()
                return seen.json()
            ok &= refits(arch, HTTPVLLMWeightSyncClient(f"{base}/{arch}", timeout=vp.TIMEOUT), tmp, check)
            say(arch=arch, weight_info=requests.get(f"{base}/{arch}/weight_info", timeout=5).json())
    finally:
        requests.post(f"{base}/quit", timeout=5)
    say(ok=ok, role="http_trainer")


if __name__ == "__main__":
    role = sys.argv[1]
    try:
        if role == "ray":
            run_ray(sys.argv[2])
        elif role == "http_engine":
            run_http_engine(int(sys.argv[2]))
        elif role == "http_trainer":
            run_http_trainer(int(sys.argv[2]))
    except BaseException:  # noqa: BLE001 - reported, then the exit code says so
        traceback.print_exc()
        sys.stdout.flush()
        os._exit(1)
    os._exit(0)  # vLLM's atexit handlers call torch.accelerator on a machine without one
