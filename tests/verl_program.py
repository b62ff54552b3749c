"""The `layoutlang` verl checkpoint engine across Ray actors, run by tests/test_verl_engine.py.

    verl_program.py TMP [--bench]

One Ray session (`ray.init(num_cpus=2)`, its folder under TMP): 2 trainer actors (a tiny
Qwen3 and a tiny Qwen3-MoE from transformers, built from a config, each under FSDP2 over a
gloo world of the two actors) and 2 rollout replicas of TP2 (4 actors, each holding both
models' parameters in vLLM's layout). verl's own pieces drive it: the hook module imported by
name (`import_external_libs`, as every verl worker does), the backend taken from verl's
`CheckpointEngineRegistry` by the name verl's `CheckpointEngineConfig` gives, and verl's own
`CheckpointEngineManager.update_weights` over `RayWorkerGroup`s of these actors (its call
order: abort the replicas, release their KV cache, `prepare` on every worker,
`build_topology`, `init_process_group`, `update_weights` on both sides, `finalize`, resume).
The actors' two update methods are what verl's workers do: the actor worker hands its training
engine to `send_weights` (as verl does for `delta_sharded`, and as
`layoutlang.integrations.verl.patch_actor_worker` makes verl's ActorRolloutRefWorker do), the
rollout worker passes `receive_weights(...)` to its server adapter, which iterates it.

Expected values never come from layoutlang: each step the trainer's full weights are
`full_tensor()` of every parameter (torch's own gather, computed here for the check only),
and each rollout rank's tensors are cut from them by vLLM's storage rules written out below
(`expected`). Every update runs under an allocation meter (a TorchDispatchMode in the actor's
thread and in the thread the refit runs in) with `DTensor.full_tensor` / `redistribute` made to
raise: the bytes an update allocates on an actor stay within the budget (torch's allocations;
the jobs' shared-memory links, docs/runtime.md, are outside torch). `--bench` adds verl's `nccl`-style path (rank 0
gathers every full tensor and sends each to the rollout group) measured in the same session.
Every line printed is JSON; the last is {"ok": true, ...} or the program exits 1.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import sys
import time
import traceback
import weakref
from pathlib import Path

import torch

from layoutlang.runtime import RefitHooks

ROOT = Path(__file__).resolve().parent.parent
HOOK = "layoutlang.integrations.verl"
STEPS = 3
TRAINERS, TP, REPLICAS = 2, 2, 2
BUCKET_MB = 1      # verl's update_weights_bucket_megabytes: the plan's budget_bytes (1 MiB)
TIMEOUT = 60.0
BASE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, vocab_size=8192, rms_norm_eps=1e-6, tie_word_embeddings=False,
            max_position_embeddings=128, rope_theta=10000.0)
ARCHS = {"qwen3": dict(BASE, model_type="qwen3"),
         "qwen3_moe": dict(BASE, model_type="qwen3_moe", moe_intermediate_size=32, num_experts=4,
                           num_experts_per_tok=2, decoder_sparse_step=1, mlp_only_layers=[], norm_topk_prob=True)}
SENTINEL = float("nan")


def say(**fields) -> None:
    print(json.dumps(fields), flush=True)


def verl_config():
    """The checkpoint-engine section of a verl config naming this backend (verl's own dataclass)."""
    from verl.workers.config import CheckpointEngineConfig

    return CheckpointEngineConfig(backend="layoutlang", update_weights_bucket_megabytes=BUCKET_MB,
                                  custom_backend_module=HOOK, engine_kwargs={"layoutlang": {"timeout": TIMEOUT}})


def new_engine(config, **extra):
    """What verl's workers do: import the hook module, then build the backend by its name."""
    from verl.checkpoint_engine import CheckpointEngineRegistry
    from verl.utils.import_utils import import_external_libs

    import_external_libs(config.custom_backend_module or None)
    bucket_size = config.update_weights_bucket_megabytes << 20
    return CheckpointEngineRegistry.new(config.backend, bucket_size=bucket_size,
                                        **config.engine_kwargs.get(config.backend, {}), **extra)


# ---- vLLM's storage rules, written out (the reference) ---------------------------------------------

def hf_checkpoint(cfg: dict, full: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """transformers 5's in-memory tensors -> checkpoint tensors: stacked experts unstacked
    (`gate_up_proj [E, 2I, H]`: gate rows then up rows; `down_proj [E, H, I]`)."""
    out = {}
    for name, t in full.items():
        if name.endswith("mlp.experts.gate_up_proj"):
            pre, i = name.removesuffix("gate_up_proj"), t.shape[1] // 2
            for e in range(t.shape[0]):
                out[f"{pre}{e}.gate_proj.weight"], out[f"{pre}{e}.up_proj.weight"] = t[e, :i], t[e, i:]
        elif name.endswith("mlp.experts.down_proj"):
            pre = name.removesuffix("down_proj")
            for e in range(t.shape[0]):
                out[f"{pre}{e}.down_proj.weight"] = t[e]
        else:
            out[name] = t
    return out


def expected(cfg: dict, ck: dict, r: int) -> dict[str, torch.Tensor]:
    """vLLM's TP rank r of TP: fused q|k|v of its heads, gate|up of its rows, o/down its columns,
    the vocabulary padded to a multiple of 64 (zeros) and split, FusedMoE's w13 (each expert's
    gate rows then up rows of this rank) and w2 (its columns of each expert's down)."""
    def rows(t, n):
        return t[r * n:(r + 1) * n]

    H, V, D = cfg["hidden_size"], cfg["vocab_size"], cfg["head_dim"]
    qd, kd = cfg["num_attention_heads"] // TP * D, cfg["num_key_value_heads"] // TP * D
    padded = -(-V // 64) * 64
    out = {"model.norm.weight": ck["model.norm.weight"]}
    for name in ("model.embed_tokens.weight", "lm_head.weight"):
        whole = ck[name].new_zeros(padded, H)
        whole[:V] = ck[name]
        out[name] = rows(whole, padded // TP)
    for layer in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{layer}."
        for k in ("input_layernorm.weight", "post_attention_layernorm.weight", "self_attn.q_norm.weight",
                  "self_attn.k_norm.weight"):
            out[p + k] = ck[p + k]
        out[p + "self_attn.qkv_proj.weight"] = torch.cat([rows(ck[p + "self_attn.q_proj.weight"], qd),
                                                          rows(ck[p + "self_attn.k_proj.weight"], kd),
                                                          rows(ck[p + "self_attn.v_proj.weight"], kd)])
        out[p + "self_attn.o_proj.weight"] = ck[p + "self_attn.o_proj.weight"][:, r * qd:(r + 1) * qd]
        if cfg["model_type"] == "qwen3_moe":
            i = cfg["moe_intermediate_size"] // TP
            x = [f"{p}mlp.experts.{e}." for e in range(cfg["num_experts"])]
            out[p + "mlp.gate.weight"] = ck[p + "mlp.gate.weight"]
            out[p + "mlp.experts.routed_experts.w13_weight"] = torch.stack([
                torch.cat([rows(ck[q + "gate_proj.weight"], i), rows(ck[q + "up_proj.weight"], i)]) for q in x])
            out[p + "mlp.experts.routed_experts.w2_weight"] = torch.stack([
                ck[q + "down_proj.weight"][:, r * i:(r + 1) * i] for q in x])
        else:
            f = cfg["intermediate_size"] // TP
            out[p + "mlp.gate_up_proj.weight"] = torch.cat([rows(ck[p + "mlp.gate_proj.weight"], f),
                                                            rows(ck[p + "mlp.up_proj.weight"], f)])
            out[p + "mlp.down_proj.weight"] = ck[p + "mlp.down_proj.weight"][:, r * f:(r + 1) * f]
    return out


def checkpoint_shapes(cfg: dict) -> dict[str, torch.Tensor]:
    """The model's checkpoint tensors on the meta device (names and shapes written out)."""
    H, D, V = cfg["hidden_size"], cfg["head_dim"], cfg["vocab_size"]
    shapes = {"model.embed_tokens.weight": (V, H), "model.norm.weight": (H,), "lm_head.weight": (V, H)}
    for layer in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{layer}."
        shapes |= {p + "input_layernorm.weight": (H,), p + "post_attention_layernorm.weight": (H,),
                   p + "self_attn.q_norm.weight": (D,), p + "self_attn.k_norm.weight": (D,),
                   p + "self_attn.q_proj.weight": (cfg["num_attention_heads"] * D, H),
                   p + "self_attn.k_proj.weight": (cfg["num_key_value_heads"] * D, H),
                   p + "self_attn.v_proj.weight": (cfg["num_key_value_heads"] * D, H),
                   p + "self_attn.o_proj.weight": (H, cfg["num_attention_heads"] * D)}
        if cfg["model_type"] == "qwen3_moe":
            i = cfg["moe_intermediate_size"]
            shapes[p + "mlp.gate.weight"] = (cfg["num_experts"], H)
            for e in range(cfg["num_experts"]):
                q = f"{p}mlp.experts.{e}."
                shapes |= {q + "gate_proj.weight": (i, H), q + "up_proj.weight": (i, H), q + "down_proj.weight": (H, i)}
        else:
            f = cfg["intermediate_size"]
            shapes |= {p + "mlp.gate_proj.weight": (f, H), p + "mlp.up_proj.weight": (f, H),
                       p + "mlp.down_proj.weight": (H, f)}
    return {k: torch.empty(v, device="meta") for k, v in shapes.items()}


def rollout_model(cfg: dict, r: int) -> torch.nn.Module:
    """A module tree with vLLM's parameter names and TP rank r's shapes, filled with NaN."""
    module = torch.nn.Module()
    for name, t in expected(cfg, checkpoint_shapes(cfg), r).items():
        *path, leaf = name.split(".")
        node = module
        for part in path:
            if not hasattr(node, part):
                node.add_module(part, torch.nn.Module())
            node = getattr(node, part)
        node.register_parameter(leaf, torch.nn.Parameter(torch.full(t.shape, SENTINEL), requires_grad=False))
    return module


def build_hf(cfg: dict):
    from transformers import AutoConfig, AutoModelForCausalLM

    fields = {k: v for k, v in cfg.items() if k != "model_type"}
    config = AutoConfig.for_model(cfg["model_type"], **fields)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32)


# ---- the allocation meter ----------------------------------------------------------------------

class Meter:
    """Bytes of new storage that torch ops allocate in the thread it runs in (live and peak),
    with DTensor's gathers made to raise while it runs."""

    def __init__(self, guard: bool = True):
        self.live = self.peak = self.total = self.biggest = self.sent = 0
        self.gathers: list[str] = []
        self.guard = guard

    def run(self, fn, *args, **kwargs):
        with self.watch():
            return fn(*args, **kwargs)

    @contextlib.contextmanager
    def watch(self):
        """Meter this thread's torch ops (and, with `guard`, make DTensor gathers raise) inside."""
        from torch.distributed.tensor import DTensor
        from torch.utils._python_dispatch import TorchDispatchMode
        from torch.utils._pytree import tree_leaves

        meter = self

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                kwargs = kwargs or {}
                name = str(func)
                if "all_gather" in name or "broadcast" in name:
                    meter.gathers.append(name)
                inputs = {storage_of(t)[0] for t in tree_leaves((args, kwargs))}
                out = func(*args, **kwargs)
                for t in tree_leaves(out):
                    ptr, nbytes = storage_of(t)
                    if ptr and ptr not in inputs and nbytes:
                        meter.grew(nbytes)
                        weakref.finalize(t, meter.freed, nbytes)
                return out

        def refuse(*a, **k):
            meter.gathers.append("DTensor gather")
            raise AssertionError("the engine gathered a DTensor")

        saved = DTensor.full_tensor, DTensor.redistribute
        if self.guard:
            DTensor.full_tensor = DTensor.redistribute = refuse
        try:
            with Mode():
                yield self
        finally:
            DTensor.full_tensor, DTensor.redistribute = saved

    def grew(self, n):
        self.live += n
        self.total += n
        self.biggest = max(self.biggest, n)
        self.peak = max(self.peak, self.live)

    def freed(self, n):
        self.live -= n


def storage_of(t) -> tuple[int, int]:
    """(data pointer, bytes) of a tensor's storage (a DTensor's: its local shard's); (0, 0) for
    anything else."""
    from torch.distributed.tensor import DTensor

    if isinstance(t, DTensor):
        t = t._local_tensor
    if type(t) is not torch.Tensor and type(t) is not torch.nn.Parameter or t.device.type == "meta":
        return 0, 0
    storage = t.untyped_storage()
    return storage.data_ptr(), storage.nbytes()


class SendCounter(RefitHooks):
    """A refit seam (RefitHooks.on_send): the bytes of every buffer this rank sends, as it goes
    on the wire."""

    def __init__(self):
        self.sent = 0

    def on_send(self, buf, op):
        self.sent += buf.nbytes
        return buf


def metered(meter: Meter):
    import asyncio

    def run_blocking(fn, *args, **kwargs):
        return asyncio.to_thread(meter.run, fn, *args, **kwargs)
    return run_blocking


# ---- the actors -----------------------------------------------------------------------------------

def actor_classes():
    import ray
    from verl.single_controller.base.decorator import Dispatch, register

    class TrainerWorker:
        """An actor worker of verl: FSDP2 models on a gloo world of the trainer actors."""

        def __init__(self, rank: int, world: int, port: int):
            import torch.distributed as dist
            from torch.distributed.device_mesh import init_device_mesh
            from torch.distributed.fsdp import fully_shard

            dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
            self.rank = rank
            mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
            self.models, self.engines, self.meters, self.counters = {}, {}, {}, {}
            for arch, cfg in ARCHS.items():
                torch.manual_seed(0)
                model = build_hf(cfg)
                for layer in model.model.layers:
                    fully_shard(layer, mesh=mesh)
                fully_shard(model, mesh=mesh)
                self.models[arch] = model
                engine = new_engine(verl_config(), is_master=dist.get_rank() == 0)
                self.engines[arch] = engine
            self.arch = None

        def pid(self):
            return os.getpid(), time.process_time()

        def use(self, arch: str):
            self.arch = arch

        def train(self, step: int):
            """An update of every local shard (what an optimizer step does to FSDP2's shards)."""
            with torch.no_grad():
                for model in self.models.values():
                    for p in model.parameters():
                        p.to_local().mul_(0.5).add_(0.125 * (self.rank + 1) + 0.01 * step)

        def full(self, arch: str):
            """The trainer's full weights (torch's own gather; the reference only)."""
            return {n: p.full_tensor().clone() for n, p in self.models[arch].named_parameters()}

        def shard_bytes(self, arch: str) -> int:
            return sum(p.to_local().nbytes for p in self.models[arch].parameters())

        @register(dispatch_mode=Dispatch.DP_COMPUTE, blocking=False)
        def execute_checkpoint_engine(self, method: str, *args, **kwargs):
            return getattr(self.engines[self.arch], method)(*args, **kwargs)

        @register(dispatch_mode=Dispatch.ONE_TO_ALL, blocking=False)
        async def update_weights(self, global_steps: int = None, mode: str = "auto"):
            engine, meter = self.engines[self.arch], Meter()
            engine.run_blocking = metered(meter)
            engine.hooks = self.counters.setdefault(self.arch, SendCounter())
            before = engine.hooks.sent
            training_engine = type("Engine", (), {"module": self.models[self.arch]})()
            with meter.watch():  # this thread too (describing, the local tensors): no gather, no copy
                metrics = await engine.send_weights(training_engine, global_steps=global_steps)
            meter.sent = engine.hooks.sent - before
            self.meters[self.arch] = meter
            return metrics

        def meter(self, arch: str) -> dict:
            m = self.meters[arch]
            return {"peak": m.peak, "total": m.total, "biggest": m.biggest, "gathers": m.gathers,
                    "budget": self.engines[arch].budget_bytes, "shards": self.shard_bytes(arch),
                    "sent": m.sent, "planned": planned_bytes(self.engines[arch])}

        def standin(self, arch: str) -> dict:
            """verl's `nccl` path, by hand: every full tensor gathered (collective over the actor
            group), rank 0 broadcasts each to the rollout group (here: bytes counted as its
            broadcast sends them once)."""
            meter, sent = Meter(guard=False), 0

            def gather():
                nonlocal sent
                for _, p in self.models[arch].named_parameters():
                    full = p.full_tensor()
                    if self.rank == 0:
                        sent += full.nbytes   # what its broadcast puts on the wire, once
                    del full
            meter.run(gather)
            return {"peak": meter.peak, "biggest": meter.biggest, "sent": sent}

        def close(self):
            for engine in self.engines.values():
                engine.close()

    class RolloutWorker:
        """A rollout worker: vLLM's layout of both models at TP rank `rank` (its parameters)."""

        def __init__(self, rank: int, replica: str):
            from layoutlang.integrations.vllm import engine_layout

            self.rank, self.models, self.engines, self.meters, self.calls = rank, {}, {}, {}, []
            for arch, cfg in ARCHS.items():
                self.models[arch] = rollout_model(cfg, rank)
                engine = new_engine(verl_config())     # as CheckpointEngineWorker builds it
                engine.bind_rollout(self.models[arch], engine_layout(cfg, dtype="float32", tp=TP), rank=rank,
                                    replica=replica)
                self.engines[arch] = engine
            self.arch = None

        def pid(self):
            return os.getpid(), time.process_time()

        def use(self, arch: str):
            self.arch = arch

        @register(dispatch_mode=Dispatch.DP_COMPUTE, blocking=False)
        def execute_checkpoint_engine(self, method: str, *args, **kwargs):
            return getattr(self.engines[self.arch], method)(*args, **kwargs)

        @register(dispatch_mode=Dispatch.ONE_TO_ALL, blocking=False)
        async def update_weights(self, global_steps: int = None):
            """verl's CheckpointEngineWorker.update_weights: the server adapter iterates the weights."""
            engine, meter = self.engines[self.arch], Meter()
            engine.run_blocking = metered(meter)
            weights = engine.receive_weights(global_steps=global_steps)
            async for _ in weights:
                raise AssertionError("the layoutlang engine yields no weights: it wrote them in place")
            self.meters[self.arch] = meter
            self.calls.append(("update_weights", global_steps))

        def check(self, arch: str, full: dict, step: int) -> dict:
            cfg = ARCHS[arch]
            want = expected(cfg, hf_checkpoint(cfg, full), self.rank)
            have = dict(self.models[arch].named_parameters())
            bad = sorted(set(want) ^ set(have)) + [n for n in want if n in have and not torch.equal(have[n], want[n])]
            m = self.meters[arch]
            return {"rank": self.rank, "replica": self.engines[arch].topology["replica"], "bad": bad, "elements": sum(t.numel() for t in want.values()),
                    "version": self.engines[arch].version, "peak": m.peak, "gathers": m.gathers,
                    "budget": self.engines[arch].budget_bytes}

        def close(self):
            for engine in self.engines.values():
                engine.close()

    return ray.remote(num_cpus=0)(TrainerWorker), ray.remote(num_cpus=0)(RolloutWorker)


def planned_bytes(engine) -> int:
    """The bytes the plan of the last refit has this trainer rank send (beside the measured ones)."""
    totals = [sum(op.bytes for op in walk.plan.ops if op.src_rank == walk.rank and not op.local)
              for walk in engine.job._walks.values()]
    return max(totals, default=0)


class Replica:
    """What verl's CheckpointEngineManager reads of a RolloutReplica: its workers, and the
    partial-rollout hooks it calls around an update (recorded here)."""

    def __init__(self, workers, log):
        self.workers, self.log = workers, log

    async def abort_all_requests(self, reject_request: bool = False):
        self.log.append("abort")

    async def release_kv_cache(self):
        self.log.append("release_kv_cache")

    async def resume_kv_cache(self):
        self.log.append("resume_kv_cache")

    async def resume_generation(self):
        self.log.append("resume_generation")


def session_processes(tmp: str) -> list[int]:
    """Every live process of the Ray session in folder `tmp` but this one (they name it)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) not in (os.getpid(), os.getppid()):
            try:
                if tmp.encode() in (entry / "cmdline").read_bytes():
                    pids.append(int(entry.name))
            except OSError:
                continue
    return pids


def cpu_of(pid: int) -> float:
    """CPU seconds (user + system) process `pid` has used so far (0 when it is gone)."""
    try:
        fields = (Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def wait_gone(tmp: str, seconds: float = 20.0) -> list[int]:
    deadline = time.monotonic() + seconds
    while (left := session_processes(tmp)) and time.monotonic() < deadline:
        time.sleep(0.5)
    return left


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main(tmp: str, bench: bool) -> bool:
    import ray
    from verl.checkpoint_engine import CheckpointEngineManager
    from verl.single_controller.ray import RayClassWithInitArgs, RayWorkerGroup

    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT / "tests"), str(ROOT),
                                                           os.environ.get("PYTHONPATH")) if p)
    began = time.monotonic()
    ray.init(num_cpus=2, _temp_dir=tmp, include_dashboard=False, log_to_driver=False)
    ok = True
    try:
        Trainer, Rollout = actor_classes()
        port = free_port()
        trainers = [Trainer.remote(r, TRAINERS, port) for r in range(TRAINERS)]
        rollouts = [Rollout.remote(t, f"replica-{i}") for i in range(REPLICAS) for t in range(TP)]
        up = ray.get([a.pid.remote() for a in trainers + rollouts])
        say(ray="up", pids=[p for p, _ in up], cpu=[round(c, 2) for _, c in up], seconds=time.monotonic() - began)
        actor_wg = RayWorkerGroup(worker_handles=trainers, ray_cls_with_init=RayClassWithInitArgs(cls=Trainer))
        log: list[str] = []
        replicas = [Replica(rollouts[i * TP:(i + 1) * TP], log) for i in range(REPLICAS)]
        manager = CheckpointEngineManager(verl_config(), actor_wg, replicas)  # imports the hook, gets the backend
        say(backend=manager.backend_cls.__module__ + "." + manager.backend_cls.__qualname__)
        for arch in ARCHS:
            ray.get([a.use.remote(arch) for a in trainers + rollouts])
            for step in range(1, STEPS + 1):
                ray.get([t.train.remote(step) for t in trainers])
                del log[:]
                t0 = time.monotonic()
                metrics = manager.update_weights(global_steps=step)
                seconds = time.monotonic() - t0
                fulls = ray.get([t.full.remote(arch) for t in trainers])
                full = fulls[0]
                checks = ray.get([r.check.remote(arch, full, step) for r in rollouts])
                meters = ray.get([t.meter.remote(arch) for t in trainers])
                say(arch=arch, step=step, seconds=seconds, metrics=metrics, hooks=list(log), checks=checks,
                    trainers=meters)
            if bench:
                fair = sum(m["sent"] for m in meters) / TRAINERS
                standin = ray.get([t.standin.remote(arch) for t in trainers])
                fair_standin = sum(s["sent"] for s in standin) / TRAINERS
                say(arch=arch, bench=True, layoutlang_busiest=max(m["sent"] for m in meters), layoutlang_fair=fair,
                    layoutlang_ratio=max(m["sent"] for m in meters) / fair,
                    standin_busiest=max(s["sent"] for s in standin), standin_fair=fair_standin,
                    standin_ratio=max(s["sent"] for s in standin) / fair_standin,
                    layoutlang_peak=max(m["peak"] for m in meters), standin_peak=max(s["peak"] for s in standin))
        ray.get([a.close.remote() for a in rollouts])
        ray.get([a.close.remote() for a in trainers])
        pids = [p for p, _ in up] + session_processes(tmp) + [os.getpid()]
        say(cpu_seconds=round(sum(cpu_of(p) for p in set(pids)), 1), wall=round(time.monotonic() - began, 1))
    except Exception:  # noqa: BLE001 - reported as the program's failure
        traceback.print_exc()
        ok = False
    finally:
        ray.shutdown()
    left = wait_gone(tmp)
    say(ray="down", left=left, seconds=time.monotonic() - began)
    return ok and not left


if __name__ == "__main__":
    ok = main(sys.argv[1], "--bench" in sys.argv[2:])
    say(ok=ok)
    sys.exit(0 if ok else 1)
