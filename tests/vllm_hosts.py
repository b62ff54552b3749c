"""A vLLM engine's weight-sync surface in one process, for tests under .venv-vllm (not a test module).

What a trainer's client reaches in a real deployment is vLLM's code all the way down: an
`LLM` (its RL entry points, `RLOfflineMixin`) or an `AsyncLLM` (the `EngineClient` that
vLLM's RL HTTP routes call) unwraps the request and sends `collective_rpc` to every worker,
whose `Worker` methods parse the dict into the backend's init / update info and call the
backend. Here the same classes' own methods run, with one stand-in: the engine core between
them and the worker (`InProcessCore`: `collective_rpc` calls the worker in this process,
as `VLLM_ENABLE_V1_MULTIPROCESSING=0` does, without a scheduler or a KV cache to build).

    host = EngineHost("llama", tmp)          # vm.build: the model and an oracle, the backend
    llm = host.llm()                         # vLLM's LLM entry points (a Ray actor's too)
    client = host.engine_client()            # vLLM's AsyncLLM methods, for the HTTP routes
    host.check(step)                         # the live model against vLLM's own load of step

Importing this module imports vLLM (run it under .venv-vllm/bin/python only).
"""

from __future__ import annotations

import asyncio
import sys
import tempfile
import threading
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import vllm_models as vm  # noqa: E402

vm.setup_env()
from vllm.config import set_current_vllm_config  # noqa: E402
from vllm.entrypoints.rl.offline import RLOfflineMixin  # noqa: E402
from vllm.v1.engine.async_llm import AsyncLLM  # noqa: E402
from vllm.v1.engine.llm_engine import LLMEngine  # noqa: E402
from vllm.v1.worker.gpu_worker import Worker  # noqa: E402 - CPUWorker's weight-transfer methods are these
from vllm.v1.worker.lora_model_runner_mixin import LoRAModelRunnerMixin  # noqa: E402

import vllm_program as vp  # noqa: E402


class ModelRunner:
    """What `Worker.finish_weight_update` asks of its model runner: vLLM's own LoRA reset (no LoRA here)."""

    reset_lora_state = LoRAModelRunnerMixin.reset_lora_state
    lora_config = None

    def __init__(self, model) -> None:
        self.model = model

    def get_model(self):
        return self.model


class WeightSyncWorker:
    """One vLLM worker's weight-transfer methods, vLLM's own (`Worker`, which `CPUWorker`
    inherits), over a model built by vLLM's loader and the backend vLLM's factory builds."""

    init_weight_transfer_engine = Worker.init_weight_transfer_engine
    shutdown_weight_transfer_engine = Worker.shutdown_weight_transfer_engine
    start_weight_update = Worker.start_weight_update
    _start_weight_update = Worker._start_weight_update
    update_weights = Worker.update_weights
    finish_weight_update = Worker.finish_weight_update
    _check_weight_transfer_engine = Worker._check_weight_transfer_engine

    def __init__(self, vllm_config, model) -> None:
        self.vllm_config = vllm_config
        self.rank = 0
        self.model_runner = ModelRunner(model)
        self.weight_transfer_engine = vp.make_engine(vllm_config, model)
        self._weight_update_active = False
        self._weight_update_is_draft = False


class InProcessCore:
    """The engine core client between `LLMEngine` / `AsyncLLM` and the worker: each
    `collective_rpc` runs the worker method here (under the worker's config, as vLLM's worker
    process runs it), and the committed weight version is kept. `calls`: the methods run."""

    def __init__(self, worker: WeightSyncWorker) -> None:
        self.worker = worker
        self.version = "0"
        self.calls: list[str] = []
        self.lock = threading.Lock()

    def collective_rpc(self, method, timeout=None, args=(), kwargs=None) -> list:
        with self.lock:
            self.calls.append(method if isinstance(method, str) else "callable")
        fn = getattr(self.worker, method) if isinstance(method, str) else (lambda *a, **k: method(self.worker, *a, **k))
        with set_current_vllm_config(self.worker.vllm_config), vm.cpu_accelerator_noops():
            return [fn(*args, **(kwargs or {}))]

    async def collective_rpc_async(self, method, timeout=None, args=(), kwargs=None) -> list:
        # off the event loop, as AsyncLLM's RPC to a worker process is: a refit's
        # update_weights blocks until the trainer has sent, while the server answers others
        return await asyncio.to_thread(self.collective_rpc, method, timeout, args, kwargs)

    def set_weight_version(self, version: str) -> None:
        self.version = version

    def get_weight_version(self) -> str:
        return self.version

    async def set_weight_version_async(self, version: str) -> None:
        self.version = version

    async def get_weight_version_async(self) -> str:
        return self.version


class EngineCore:
    """`LLMEngine`'s methods that `LLM`'s RL entry points call, vLLM's own, over the core."""

    collective_rpc = LLMEngine.collective_rpc
    set_weight_version = LLMEngine.set_weight_version
    get_weight_version = LLMEngine.get_weight_version

    def __init__(self, core: InProcessCore) -> None:
        self.engine_core = core


class HostedLLM(RLOfflineMixin):
    """`vllm.LLM`'s RL entry points (vLLM's `RLOfflineMixin`, the class `LLM` takes them from)."""

    def __init__(self, core: InProcessCore) -> None:
        self.llm_engine = EngineCore(core)


class HostedAsyncLLM:
    """What vLLM's RL HTTP routes call on `app.state.engine_client`: `AsyncLLM`'s own methods."""

    init_weight_transfer_engine = AsyncLLM.init_weight_transfer_engine
    shutdown_weight_transfer_engine = AsyncLLM.shutdown_weight_transfer_engine
    start_weight_update = AsyncLLM.start_weight_update
    update_weights = AsyncLLM.update_weights
    finish_weight_update = AsyncLLM.finish_weight_update
    update_weight_version = AsyncLLM.update_weight_version
    get_weight_version = AsyncLLM.get_weight_version
    collective_rpc = AsyncLLM.collective_rpc

    def __init__(self, core: InProcessCore) -> None:
        self.engine_core = core


class EngineHost:
    """One engine of `arch` (tests/vllm_program.ARCHS) at TP1, built by vLLM's model loader, with
    the `layoutlang` backend from vLLM's factory, and an oracle model of the same config."""

    def __init__(self, arch: str, tmp: str | None = None) -> None:
        tmp = Path(tmp or tempfile.mkdtemp())
        self.arch, self.cfg = arch, vp.ARCHS[arch]
        self.vllm_config, self.model = vm.build(self.cfg, tmp / f"{arch}-engine")
        _, self.oracle = vm.build(self.cfg, tmp / f"{arch}-oracle")
        self.storage = {n: p.data_ptr() for n, p in self.model.named_parameters()}
        self.core = InProcessCore(WeightSyncWorker(self.vllm_config, self.model))

    def llm(self) -> HostedLLM:
        return HostedLLM(self.core)

    def engine_client(self) -> HostedAsyncLLM:
        return HostedAsyncLLM(self.core)

    def check(self, step: int) -> dict:
        """The live model after refit `step`: every parameter and buffer that is not what vLLM's own
        `load_weights` writes from the trainer's checkpoint of that step (tests/vllm_program.py
        `checkpoint`, the same seed the trainer sends), the parameters whose storage moved, the
        backend's version and the engine's committed weight version."""
        vm.load_hf_weights(self.oracle, vp.checkpoint(self.cfg, step), self.vllm_config)
        engine = self.core.worker.weight_transfer_engine
        return {"arch": self.arch, "step": step, "differ": vp.differences(self.model, self.oracle)[:10],
                "moved_storage": [n for n, p in self.model.named_parameters() if self.storage.get(n) != p.data_ptr()],
                "version": engine.version, "weight_version": self.core.version,
                "parameters": len(self.storage)}
