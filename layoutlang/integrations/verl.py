"""The `layoutlang` checkpoint engine for verl (0.9): every trainer rank sends its own shards.

verl picks the weight sync between its actor (trainer) workers and its rollout replicas by
name from `CheckpointEngineRegistry`; `rollout.checkpoint_engine.custom_backend_module` is
imported on every worker before the engine is built. Importing this module registers the
engine as `"layoutlang"`::

    actor_rollout_ref.rollout.checkpoint_engine.backend=layoutlang
    actor_rollout_ref.rollout.checkpoint_engine.custom_backend_module=layoutlang.integrations.verl
    actor_rollout_ref.rollout.checkpoint_engine.update_weights_bucket_megabytes=512    # budget_bytes
    +actor_rollout_ref.rollout.checkpoint_engine.engine_kwargs.layoutlang.timeout=120  # seconds a refit

Each update runs the calls of verl's `CheckpointEngineManager.update_weights`, in its order:

| verl calls | trainer rank r (actor worker) | rollout worker (rank t of replica i) |
|---|---|---|
| `prepare()` | rank 0 hosts the trainer job's store (first call) and returns its address | returns its replica's layout text and its rank count |
| `build_topology(N, W, metadata)` | the plan's ranks: trainer rank r is plan rank r; every trainer learns the replicas' layout and ids | consecutive workers form a replica of the layout's rank count; replica i's rank t is plan rank N + t*K + i |
| `init_process_group(**kw)` | keeps the address, the replicas (the `TrainerJob` is built at the first send, from the module) | builds (once) its `EngineJob` (address, replica id, rank) |
| `send_weights(engine, global_steps)` / `receive_weights(global_steps)` | `TrainerJob.refit` of this rank's own shards (the bridge's local tensors: FSDP2 / DTensor or Megatron-Core), `expect=` every replica of the topology; version = global_steps | `EngineJob.receive` straight into the bound parameters; yields nothing (the parameters are written) |
| `finalize()` | nothing to free (the walk's staging goes with it) | idem |

Nothing is ever gathered: the trainer's tensors are the module's local shards (views), and
the plan moves each rank's rows to the replicas' ranks that hold them (docs/jobs.md).

What is sent is the training engine's module, never verl's full-tensor generator. verl's
actor worker passes the generator of `get_per_tensor_param()` to every backend but
`delta_sharded`; `send_weights` accepts a verl training engine (anything with `.module`), an
`nn.Module`, or the generator when the module was bound (`engine.bind_trainer(module)`): then
the generator is closed unread (iterating it would gather every tensor on every rank). Importing
this module on an actor worker whose `verl.workers.engine_workers` is loaded also makes that
worker hand its training engine to this backend, as verl does for `delta_sharded`
(`patch_actor_worker`).

The rollout side writes the parameters it is bound to (`engine.bind_rollout(model_or_tensors,
layout)`: an HF model in vLLM's or SGLang's layout, checked against that layout before a byte
moves). A vLLM server takes a refit inside its own workers through vLLM's weight-transfer
backend (layoutlang.integrations.vllm, docs/engines.md).

This module imports verl when imported (it is verl's plug-in hook); the bridges import their
frameworks inside the calls that need them.
"""

from __future__ import annotations

import asyncio
import time
from datetime import timedelta

import torch
from verl.checkpoint_engine.base import CheckpointEngine, CheckpointEngineRegistry

from layoutlang.diagnostics import UsageError

BACKEND = "layoutlang"
TRAINER, ROLLOUT = "trainer", "rollout"


class VerlEngineError(UsageError):
    """The verl checkpoint engine cannot run as configured: nothing was moved."""


def _module_of(source):
    """The training module behind what verl hands `send_weights`: a verl training engine
    (its `.module`), the module itself, or None (a generator, a mapping)."""
    if isinstance(source, torch.nn.Module):
        return source
    module = getattr(source, "module", None)
    if isinstance(module, (list, tuple)) and len(module) == 1:  # verl's Megatron engine: model chunks
        module = module[0]
    if isinstance(module, (list, tuple)):
        raise VerlEngineError(f"the training engine holds {len(module)} model chunks (virtual pipeline stages), "
                              "which the Megatron bridge does not describe")
    return module if isinstance(module, torch.nn.Module) else None


def _is_megatron(module) -> bool:
    inner = module
    while hasattr(inner, "module") and isinstance(inner.module, torch.nn.Module):
        inner = inner.module  # DDP / Float16Module wrappers
    return type(inner).__module__.startswith("megatron.")


def describe_trainer(module) -> tuple[str, dict[str, torch.Tensor]]:
    """The trainer's layout text and this rank's own tensors (views of the module's shards):
    Megatron-Core through layoutlang.bridges.megatron, a transformers model (whole, FSDP2 or a
    TP plan) through layoutlang.bridges.hf, any other DTensor module through
    layoutlang.bridges.dtensor."""
    if hasattr(module, "peft_config") or hasattr(getattr(module, "_fsdp_wrapped_module", None), "peft_config"):
        raise VerlEngineError("the actor's model carries LoRA adapters (peft): the layoutlang engine refits base "
                              "weights only; merge the adapters (model.lora.merge=True) or use verl's nccl backend")
    if _is_megatron(module):
        from layoutlang.bridges import megatron

        return megatron.describe(module), megatron.tensors(module)
    if hasattr(module, "config") and hasattr(module.config, "model_type"):
        from layoutlang.bridges import hf

        return hf.describe(module), hf.tensors(module)
    from layoutlang.bridges import dtensor

    return dtensor.describe(module), dtensor.tensors(module)


def _local_tensors(module) -> dict[str, torch.Tensor]:
    """This rank's own tensors of `module` (views of its shards), by the bridge that describes it."""
    if _is_megatron(module):
        from layoutlang.bridges import megatron

        return megatron.tensors(module)
    from layoutlang.bridges import dtensor, hf

    return hf.tensors(module) if hasattr(getattr(module, "config", None), "model_type") else dtensor.tensors(module)


def _node_host() -> str:
    """This node's address as Ray knows it (the address other actors reach it at), else loopback."""
    try:
        import ray

        if ray.is_initialized():
            return ray.util.get_node_ip_address().strip("[]")
    except Exception:  # noqa: BLE001 - not inside a Ray worker: loopback
        pass
    return "127.0.0.1"


@CheckpointEngineRegistry.register(BACKEND)
class LayoutlangCheckpointEngine(CheckpointEngine):
    """verl's checkpoint engine on layoutlang's jobs (docs/jobs.md): one `TrainerJob` over the
    actor workers, one `EngineJob` per rollout worker, kept across updates.

    verl builds it as `CheckpointEngineRegistry.new("layoutlang", bucket_size=..., is_master=...,
    **engine_kwargs["layoutlang"])`. `bucket_size` (verl's `update_weights_bucket_megabytes`) is
    the plan's `budget_bytes`: at most that many bytes staged at once on any rank. Keyword
    arguments (`engine_kwargs.layoutlang`): `timeout` (seconds one refit may take, default 60),
    `connect_timeout` (seconds a worker waits for the trainer's store, default `timeout`),
    `verify` (each replica checks what it received), `overlap` (move bucket k+1 while k is
    written), `host` (the address trainer rank 0 publishes; default its Ray node address),
    `replica_prefix` (replica ids are PREFIX-i, default "rollout"). Two seams, as attributes:
    `hooks` (RefitHooks for the jobs' walks: set before the first update) and `run_blocking`
    (how the blocking refit or receive runs off the worker's event loop: a thread).
    """

    def __init__(self, bucket_size: int, is_master: bool = False, *, timeout: float = 60.0,
                 connect_timeout: float | None = None, verify: bool = False, overlap: bool = False,
                 host: str | None = None, replica_prefix: str = "rollout") -> None:
        if not isinstance(bucket_size, int) or bucket_size <= 0:
            raise VerlEngineError(f"bucket_size {bucket_size!r}: expected a positive number of bytes "
                                  "(checkpoint_engine.update_weights_bucket_megabytes)")
        self.budget_bytes, self.is_master = bucket_size, bool(is_master)
        self.timeout = timedelta(seconds=float(timeout))
        self.connect_timeout = timedelta(seconds=float(connect_timeout if connect_timeout is not None else timeout))
        self.verify, self.overlap = bool(verify), bool(overlap)
        self.host, self.replica_prefix = host, replica_prefix
        self.role: str | None = None
        self.module = None           # trainer: the training module (bind_trainer or send_weights)
        self.targets = None          # rollout: name -> tensor written in place (bind_rollout)
        self.infer: str | None = None  # the replica layout's text (rollout: its own; trainer: from the topology)
        self.store = None            # trainer rank 0: the TCPStore it hosts
        self.address: str | None = None
        self.topology: dict | None = None
        self.job = None              # TrainerJob or EngineJob
        self.report = None           # trainer: the last JobReport
        self.version = None          # rollout: the version its parameters hold
        self.hooks = None            # RefitHooks for the jobs' walks (test seams), set before the first update

    # ---- binding: what each side moves -----------------------------------------------------
    def bind_trainer(self, module) -> None:
        """This actor worker sends from `module` (its training engine's model: FSDP2, Megatron-Core)."""
        if _module_of(module) is None:
            raise VerlEngineError(f"bind_trainer: {type(module).__name__} is neither a module nor a training "
                                  "engine with one (`.module`)")
        self.role, self.module = TRAINER, _module_of(module)

    def bind_rollout(self, target, layout: str, *, rank: int, replica: str | None = None) -> None:
        """This rollout worker, TP rank `rank` of its replica, writes `target` (a module's
        parameters, or a name -> tensor mapping) in place, described by `layout` (the text of ONE
        replica, e.g. `layoutlang.integrations.vllm.engine_layout(config, dtype=..., tp=TP)`).
        `replica`: the replica's id, the same on all its workers (verl's `replica_rank` makes
        one: `f"rollout-{replica_rank}"`); None: the topology numbers replicas by position.
        The parameters are checked against the layout now (names, shapes, dtypes, contiguity)."""
        from layoutlang.elaborate import loads

        from .live import DirectModel, live_problems

        live = DirectModel.of(target) if isinstance(target, torch.nn.Module) else _Tensors(target)
        one = loads(layout, "<rollout layout>")
        if not 0 <= rank < one.ranks:
            raise VerlEngineError(f"bind_rollout: rank {rank} is not a rank of the layout (0..{one.ranks - 1})")
        problems = live_problems(one, rank, live, "the rollout")
        if problems:
            raise VerlEngineError("the rollout's parameters are not its layout, nothing was moved: "
                                  + "; ".join(problems[:8]))
        self.role, self.targets, self.infer = ROLLOUT, live.tensors(), layout
        self.rollout_rank, self.rollout_ranks, self.replica = rank, one.ranks, replica

    # ---- verl's calls, in CheckpointEngineManager.update_weights's order --------------------
    def prepare(self) -> dict:
        """Trainer rank 0: host the job's store (once) and publish its address. A rollout worker:
        publish its replica's layout and rank count. Every worker: its role."""
        if self.role == ROLLOUT:
            return {"role": ROLLOUT, "layout": self.infer, "ranks": self.rollout_ranks, "rank": self.rollout_rank,
                    "replica": self.replica}
        self.role = TRAINER
        if self.is_master and self.store is None:
            import torch.distributed as dist

            host = self.host or _node_host()
            self.store = dist.TCPStore(host, 0, None, True, self.connect_timeout, wait_for_workers=False)
            self.address = f"{host}:{self.store.port}"
        return {"role": TRAINER, "address": self.address if self.is_master else None, "prefix": self.replica_prefix}

    @classmethod
    def build_topology(cls, actor_wg_world_size: int, rollout_world_size: int, metadata: list[dict]):
        """The plan's ranks. Trainer rank r is plan rank r; the rollout workers, in verl's order
        (each replica's workers together), form replicas of their layout's rank count R: replica i
        is `rollout-i`, its rank t plan rank N + t*K + i (layoutlang/compiler/members.py)."""
        actors, rollouts = metadata[:actor_wg_world_size], metadata[actor_wg_world_size:]
        if len(rollouts) != rollout_world_size:
            raise VerlEngineError(f"build_topology: {len(metadata)} workers reported, expected "
                                  f"{actor_wg_world_size} actor and {rollout_world_size} rollout workers")
        for i, m in enumerate(actors):
            if m.get("role") != TRAINER:
                raise VerlEngineError(f"actor worker {i} prepared as a {m.get('role')}: bind_rollout on an actor?")
        for i, m in enumerate(rollouts):
            if m.get("role") != ROLLOUT:
                raise VerlEngineError(f"rollout worker {i} has no parameters bound: call "
                                      "engine.bind_rollout(model, layout) on every rollout worker first")
        addresses = [m["address"] for m in actors if m.get("address")]
        if len(addresses) != 1:
            raise VerlEngineError(f"build_topology: {len(addresses)} actor workers host a store; exactly one "
                                  "(is_master, actor rank 0) must")
        address, prefix = addresses[0], actors[0].get("prefix", "rollout")
        layout, ranks = rollouts[0]["layout"], rollouts[0]["ranks"]
        for i, m in enumerate(rollouts):
            if m["layout"] != layout:
                raise VerlEngineError(f"rollout worker {i} holds another layout than worker 0: one trainer job "
                                      "plans one replica layout (give every replica the same model, TP and dtype)")
        if rollout_world_size % ranks:
            raise VerlEngineError(f"{rollout_world_size} rollout workers do not form replicas of {ranks} ranks")
        replicas = rollout_world_size // ranks
        for i in range(replicas):
            held = [m["rank"] for m in rollouts[i * ranks:(i + 1) * ranks]]
            if sorted(held) != list(range(ranks)):
                raise VerlEngineError(f"rollout workers {i * ranks}..{(i + 1) * ranks - 1} (replica {i}) are ranks "
                                      f"{held} of their replicas: verl lists each replica's workers together, "
                                      f"so they must be ranks 0..{ranks - 1} of one replica")
        ids = []
        for i in range(replicas):
            named = {m.get("replica") for m in rollouts[i * ranks:(i + 1) * ranks]}
            if len(named) != 1:
                raise VerlEngineError(f"rollout workers {i * ranks}..{(i + 1) * ranks - 1} (replica {i}) name "
                                      f"different replica ids {sorted(map(str, named))}")
            ids.append(named.pop() or f"{prefix}-{i}")
        if len(set(ids)) != len(ids):
            raise VerlEngineError(f"replica ids {ids} repeat: each replica needs its own")
        n = actor_wg_world_size
        rank_of = [m["rank"] for m in rollouts]
        actor_kwargs = {"role": [TRAINER] * n, "rank": list(range(n)), "world_size": [n] * n,
                        "address": [address] * n, "infer": [layout] * n, "replicas": [ids] * n}
        rollout_kwargs = {"role": [ROLLOUT] * rollout_world_size,
                          "replica": [ids[w // ranks] for w in range(rollout_world_size)],
                          "rank": rank_of, "world_size": [ranks] * rollout_world_size,
                          "address": [address] * rollout_world_size,
                          "plan_rank": [n + rank_of[w] * replicas + w // ranks for w in range(rollout_world_size)]}
        return actor_kwargs, rollout_kwargs

    def init_process_group(self, *, role: str, rank: int, world_size: int, address: str, infer: str | None = None,
                           replicas=(), replica: str | None = None, plan_rank: int | None = None) -> None:
        """Keep this worker's place in the topology. A rollout worker builds its `EngineJob` (once
        per trainer address and replica id; a new topology builds a new one)."""
        self.address = address
        self.topology = {"role": role, "rank": rank, "world_size": world_size, "replicas": list(replicas),
                         "replica": replica, "plan_rank": plan_rank}
        if role == TRAINER:
            self.role, self.infer = TRAINER, infer
            return
        from layoutlang.elaborate import loads
        from layoutlang.runtime import EngineJob

        key = (address, replica, rank)
        if self.job is None or getattr(self, "_job_key", None) != key:
            if self.job is not None:
                self.job.close()
            self.job = EngineJob(loads(self.infer, "<rollout layout>"), address=address, replica=replica, rank=rank, world_size=world_size,
                                 timeout=self.timeout, connect_timeout=self.connect_timeout, hooks=self.hooks)
            self._job_key = key

    def run_blocking(self, fn, *args, **kwargs):
        """How a refit's blocking call runs off the worker's event loop (a thread)."""
        return asyncio.to_thread(fn, *args, **kwargs)

    async def send_weights(self, weights, global_steps: int | None = None) -> dict:
        """Refit every replica of the topology from this rank's own shards. `weights`: the
        training engine (or its module), or verl's full-tensor generator when a module was bound
        (closed unread). Returns verl's sync metrics."""
        module = _module_of(weights)
        if module is not None:
            self.module = module
        elif hasattr(weights, "close"):
            weights.close()  # a generator: never iterated (that would gather every tensor)
        if self.module is None:
            raise VerlEngineError("send_weights got verl's full-tensor generator and no module: the layoutlang "
                                  "engine sends each rank's own shards; pass the training engine (as verl passes "
                                  "it to delta_sharded) or call engine.bind_trainer(module) once")
        if self.topology is None or self.topology["role"] != TRAINER:
            raise VerlEngineError("send_weights before init_process_group: run verl's order (prepare, "
                                  "build_topology, init_process_group, send_weights, finalize)")
        if getattr(self, "_described", (None,))[0] is not self.module:
            self._described = (self.module, describe_trainer(self.module)[0])
        text = self._described[1]
        tensors = _local_tensors(self.module)
        if self.job is None or getattr(self, "_job_key", None) != (self.address, text, self.infer):
            self._start_trainer(text)
        began = time.monotonic()
        version = global_steps if global_steps is not None else (self.report.version + 1 if self.report else 1)
        report = await self.run_blocking(self.job.refit, tensors, version, expect=tuple(self.topology["replicas"]))
        self.report = report
        if report.missed:
            reasons = "; ".join(f"{r}: {report.reasons.get(r, '?')}" for r in report.missed)
            raise VerlEngineError(f"refit {report.refit} (version {version}) missed {len(report.missed)} of "
                                  f"{len(self.topology['replicas'])} replicas: {reasons}")
        return {"layoutlang/refit_s": time.monotonic() - began, "layoutlang/replicas": len(report.replicas)}

    def _start_trainer(self, text: str) -> None:
        from layoutlang.elaborate import loads
        from layoutlang.runtime import TrainerJob

        if self.job is not None:
            self.job.close()
        t = self.topology
        train = loads(text, "<verl actor>")
        one = loads(self.infer, "<rollout layout>")
        store = self.store if t["rank"] == 0 else None
        self.job = TrainerJob(train, one, address=None if store is not None else self.address, store=store,
                              rank=t["rank"], world_size=t["world_size"], timeout=self.timeout,
                              connect_timeout=self.connect_timeout, budget_bytes=self.budget_bytes,
                              verify=self.verify, overlap=self.overlap, hooks=self.hooks)
        self._job_key = (self.address, text, self.infer)

    async def receive_weights(self, global_steps: int | None = None):
        """Take the next refit straight into the bound parameters. An async generator, as verl's
        server adapter consumes it; it yields nothing (the parameters are written in place)."""
        if self.job is None or self.role != ROLLOUT:
            raise VerlEngineError("receive_weights before init_process_group on a bound rollout worker")
        version = await self.run_blocking(self.job.receive, self.targets)
        if global_steps is not None and version != global_steps:
            raise VerlEngineError(f"replica {self.topology['replica']} received version {version}, "
                                  f"expected {global_steps}")
        self.version = version
        return
        yield  # an async generator with nothing to yield

    def finalize(self) -> None:
        """Nothing to free: the walk's staging is released with it; the jobs stay for the next update."""

    def close(self) -> None:
        """Leave the trainer job (both sides): a rollout stops waiting; trainer rank 0 closes its store."""
        if self.job is not None:
            self.job.close()
            self.job = None


class _Tensors:
    """A name -> tensor mapping as live.live_problems reads a model."""

    def __init__(self, tensors):
        self.direct, self.refused = dict(tensors), []

    def loaded_shapes(self):
        return {n: (t.shape, t.dtype) for n, t in self.direct.items()}

    def tensors(self):
        return dict(self.direct)


def patch_actor_worker() -> bool:
    """Make verl's actor worker hand its training engine to this backend (as it does for
    `delta_sharded`) instead of `get_per_tensor_param()`'s full-tensor generator. Applied when
    this module is imported in a process where `verl.workers.engine_workers` is loaded (an actor
    worker importing the hook); returns whether it applied."""
    import sys

    workers = sys.modules.get("verl.workers.engine_workers")
    cls = getattr(workers, "ActorRolloutRefWorker", None)
    if cls is None or getattr(cls.update_weights, "_layoutlang", False):
        return False
    original = cls.update_weights

    async def update_weights(self, global_steps: int = None, mode: str = "auto"):
        engine = getattr(self, "checkpoint_engine", None)
        if isinstance(engine, LayoutlangCheckpointEngine) and mode != "naive":
            return await engine.send_weights(self.actor.engine, global_steps=global_steps) or {}
        return await original(self, global_steps=global_steps, mode=mode)

    for attr in ("__name__", "__qualname__", "__doc__", "__wrapped__"):
        if hasattr(original, attr):
            setattr(update_weights, attr, getattr(original, attr))
    for attr, value in vars(original).items():  # verl's @register dispatch attributes
        setattr(update_weights, attr, value)
    update_weights._layoutlang = True
    cls.update_weights = update_weights
    return True


patch_actor_worker()

__all__ = ["BACKEND", "LayoutlangCheckpointEngine", "VerlEngineError", "describe_trainer", "patch_actor_worker"]
