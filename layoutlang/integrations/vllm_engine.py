"""Both sides of the `layoutlang` vLLM weight-transfer backend (imports vLLM; docs/engines.md).

Worker side, `LayoutlangEngine` (vLLM builds one per worker with the live model, after it
loaded): `init_transfer_engine` writes this replica's layout from the model config and the
parallel sizes (vllm.py `engine_layout`), checks it against `model.named_parameters()`
(names, shapes, dtypes, strides: every live parameter covered, or derived from covered ones)
and joins the trainer job as one replica of an `EngineJob` (vLLM's TP workers are its
ranks). `receive_weights` is one `EngineJob.receive` straight into the parameters.

What vLLM holds is not always what it loaded: after loading, a layer's quantization method
may repack its weights into a kernel format (the CPU GEMMs and MoE experts pack theirs,
FlashInfer swaps w13 to up|gate, AITER shuffles), and MLA derives `W_UK_T` / `W_UV` from
`kv_b_proj`. A refit must never write checkpoint-format bytes into kernel-format storage,
so each module takes one of three routes, decided before a byte moves:
- direct: its storage is what it loaded (no post-load processing that changes it; on GPU:
  unquantized linear layers and embeddings, norms everywhere): the refit writes the live
  parameter itself;
- reload: its processing rewrites storage: `start_weight_update` puts the module back in
  the format it loads (vLLM's layerwise-reload metadata: fresh tensors of the loader's
  shapes), the refit writes those, and `finish_weight_update` runs the module's own
  `process_weights_after_loading` and copies the result into the kernel storage it had (the
  same `data_ptr`s, as vLLM's own reload does);
- refused, with the parameter and the reason: a quantization method whose loaded format
  no layout here describes (fp8 / mxfp4 checkpoints), a model built without vLLM's model
  loader (no reload metadata) where a reload is needed.
MLA attention layers then recompute their derived matrices from the refitted `kv_b_proj`.

With EPLB on, the layout's `EPLB` table is vLLM's live physical -> logical expert map
(`live_eplb_map`, read off the layers' EPLB state): at init, and again at every
`start_weight_update`, where a rebalanced map is published (`EngineJob.set_args`) so the
trainer plans that refit for the slots as they are.

Trainer side, `LayoutlangTrainer`: a `TrainerJob` on every trainer rank; rank 0 drives the
engines through vLLM's trainer-side client protocol (`VLLMWeightSyncClient`:
`init_weight_transfer_engine(init_info)`, then per step `start_weight_update`,
`update_weights(update_info)` concurrently with the refit, `finish_weight_update`), which
takes the init info and the update payload themselves, as vLLM's own nccl / ipc trainers
pass them to `HTTPVLLMWeightSyncClient` and `RayVLLMWeightSyncClient`. An in-process
`vllm.LLM` is no such client (its RL entry points take vLLM's request objects): `LLMClient`
adapts it.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
from vllm.distributed.weight_transfer.base import (TrainerInitInfo, TrainerWeightTransferEngine,
                                                   WeightTransferEngine, WeightTransferInitInfo,
                                                   WeightTransferInitRequest, WeightTransferUpdateInfo,
                                                   WeightTransferUpdateRequest)

from layoutlang.elaborate import loads
from layoutlang.runtime import EngineJob, TrainerJob
from layoutlang.runtime.errors import RefitError

from layoutlang.bridges.families import VLLM_EXPERT_PLACEMENTS

from .live import EngineRefused, dtype_name as _dtype_name, live_problems as _live_problems
from .vllm import BACKEND, engine_layout

LAYOUT_PATH = "vllm-replica.layout"   # the engine layout's name on both sides (its digest covers it)
# quantization methods whose post-load processing leaves the loaded storage as it is, off the CPU
DIRECT_METHODS = frozenset({"UnquantizedLinearMethod", "UnquantizedEmbeddingMethod"})
# ... and those whose processing rewrites it in a kernel format, which the reload route feeds
RELOAD_METHODS = frozenset({"UnquantizedLinearMethod", "UnquantizedEmbeddingMethod", "UnquantizedFusedMoEMethod"})
DERIVED = (".W_UK_T", ".W_UV")      # MLA's absorbed matrices, recomputed from kv_b_proj


# ---- what travels through vLLM's API (data: JSON-able dataclasses) ------------------------------

@dataclass
class LayoutlangInitInfo(WeightTransferInitInfo):
    """A worker's part of `init_weight_transfer_engine`: where the trainer job is, who we are."""

    address: str                      # HOST:PORT of the trainer job's store (its rank 0)
    replica: str                      # this engine's replica id (the same on all its workers)
    timeout: float = 60.0             # seconds, one refit (EngineJob timeout)
    connect_timeout: float | None = None


@dataclass
class LayoutlangUpdateInfo(WeightTransferUpdateInfo):
    """`update_weights`: which version to expect (checked when given), how long to wait for it."""

    version: Any = None
    wait: float | None = None


# ---- the live model, by route -----------------------------------------------------------------

def _layerwise():
    """vLLM's layerwise-reload internals the reload route uses (vLLM 0.33)."""
    try:
        from vllm.model_executor.model_loader.reload import layerwise, meta, utils
    except ImportError as exc:  # pragma: no cover - another vLLM
        raise EngineRefused(f"this vLLM has no layerwise reload ({exc}): the reload route cannot run") from None
    return layerwise, meta, utils


@dataclass
class LiveModel:
    """One worker's model, split by route; `tensors()` are the refit's destinations by name."""

    model: torch.nn.Module
    on_cpu: bool
    direct: dict[str, torch.Tensor] = field(default_factory=dict)     # parameter name -> live tensor
    reload: dict[str, torch.nn.Module] = field(default_factory=dict)  # module path -> module
    derived: list[torch.nn.Module] = field(default_factory=list)      # MLA layers to recompute
    aliases: dict[str, list[str]] = field(default_factory=dict)      # module path -> names it shares
    refused: list[str] = field(default_factory=list)
    entered: bool = False

    @classmethod
    def of(cls, model: torch.nn.Module, on_cpu: bool) -> "LiveModel":
        live = cls(model, on_cpu)
        canonical = {id(p): n for n, p in model.named_parameters()}  # a shared tensor: its first name
        for path, module in model.named_modules():
            own = {}
            for name, p in module.named_parameters(recurse=False):
                if canonical.get(id(p)) == (f"{path}.{name}" if path else name):
                    own[name] = p
                else:  # another module's parameter too (DeepSeek's score bias: the router's and the experts')
                    live.aliases.setdefault(path, []).append(name)
            if any(n.endswith(DERIVED) for n in (f"{path}.{k}" for k in own)):
                live.derived.append(module)
                continue
            if not own:
                continue
            route = live._route(path, module)
            # a reload module's parameters registered after its loaded format was recorded (DeepSeek's
            # router keeps e_score_correction_bias so) are not reprocessed: written where they live
            reloaded = set(_loaded_format(module)) if route == "reload" else set()
            for name, p in own.items():
                if route == "direct" or (route == "reload" and name not in reloaded):
                    live.direct[f"{path}.{name}" if path else name] = p
            if route == "reload":
                live.reload[path] = module
        return live

    def _route(self, path: str, module: torch.nn.Module) -> str:
        method = getattr(module, "quant_method", None)
        if method is None:
            return "direct"
        kind = type(method).__name__
        if not self.on_cpu and kind in DIRECT_METHODS:
            return "direct"
        if kind in RELOAD_METHODS:
            layerwise, _, _ = _layerwise()
            info = layerwise.LAYERWISE_INFO.get(module)
            if info is None or not info.restore_metadata[0]:
                self.refused.append(f"`{path}` ({type(module).__name__}) repacks its weights after loading and the "
                                    "model was built without vLLM's model loader (no reload metadata)")
                return "refused"
            return "reload"
        self.refused.append(f"`{path}`: quantization method {kind} stores kernel-format weights that no layout "
                            "here describes (refused: quantized engines are not refit yet)")
        return "refused"

    def loaded_shapes(self) -> dict[str, tuple[torch.Size, torch.dtype]]:
        """Every destination parameter as the refit writes it: live (direct) or as loaded (reload)."""
        out = {n: (p.shape, p.dtype) for n, p in self.direct.items()}
        for path, module in self.reload.items():
            shared = self.aliases.get(path, ())
            out.update({f"{path}.{k}": (t.shape, t.dtype) for k, t in _loaded_format(module).items()
                        if k not in shared})
        return out

    def enter(self) -> None:
        """Reload modules back in their loaded format, on fresh tensors the refit writes."""
        layerwise, meta, utils = _layerwise()
        for module in self.reload.values():
            info = layerwise.get_layerwise_info(module)
            info.kernel_tensors = utils.get_layer_params_buffers(module)
            info.kernel_non_persistent_buffers = set(module._non_persistent_buffers_set)
            meta.restore_layer_on_meta(module, info)
            meta.materialize_layer(module, info)
        for path, names in self.aliases.items():
            module = self.reload.get(path)
            if module is not None:  # the shared tensor itself, written once (under its first name)
                kept = layerwise.get_layerwise_info(module).kernel_tensors[0]
                for name in names:
                    setattr(module, name, kept[name])
        self.entered = True

    def tensors(self) -> dict[str, torch.Tensor]:
        out = dict(self.direct)
        for path, module in self.reload.items():
            shared = self.aliases.get(path, ())
            out.update({f"{path}.{k}": getattr(module, k) for k in _loaded_format(module) if k not in shared})
        return out

    def leave(self, dtype: torch.dtype, *, keep: bool) -> None:
        """Process what the refit wrote into each reload module's kernel storage (`keep`), or put
        the kernel storage back untouched (a failed refit: they hold the previous version)."""
        if not self.entered:
            return
        layerwise, _, _ = _layerwise()
        for module in self.reload.values():
            info = layerwise.get_layerwise_info(module)
            if keep:  # vLLM's own step once a layer has loaded: nothing buffered, our tensors in place
                info.loaded_weights = []
                layerwise._layerwise_process(module, info)  # process, copy into kernel storage, reset
            else:
                layerwise._place_kernel_tensors(module, info)
                info.reset()
        self.entered = False
        if keep:
            for layer in self.derived:
                layer.process_weights_after_loading(dtype)


def _loaded_format(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The parameters a module loads, as vLLM recorded them before processing (meta tensors)."""
    layerwise, _, _ = _layerwise()
    return layerwise.LAYERWISE_INFO[module].restore_metadata[0]


def live_problems(layout, rank: int, live: LiveModel) -> list[str]:
    """Why the layout is not the live model on this rank (live.py `live_problems`)."""
    return _live_problems(layout, rank, live, "vLLM")


def replica_layout(vllm_config, expert_placement: str = "linear") -> str:
    """This replica's layout text, from vLLM's own config: what the trainer must plan into
    (`expert_placement`: the expert map vLLM built, `_expert_placement` reads it)."""
    par = vllm_config.parallel_config
    if par.pipeline_parallel_size > 1 or par.data_parallel_size > 1:
        raise EngineRefused(f"pipeline parallel {par.pipeline_parallel_size}, data parallel "
                            f"{par.data_parallel_size}: the layoutlang backend describes one TP group per replica")
    hf = vllm_config.model_config.hf_config.to_dict()
    tp = par.tensor_parallel_size
    ep = tp if getattr(par, "enable_expert_parallel", False) else 1
    return engine_layout(hf, dtype=_dtype_name(vllm_config.model_config.dtype), tp=tp, ep=ep,
                         expert_placement=expert_placement, redundant_experts=redundant_experts(vllm_config))


def redundant_experts(vllm_config) -> int:
    """vLLM's EPLB `num_redundant_experts` (0 with EPLB off)."""
    par = vllm_config.parallel_config
    return int(par.eplb_config.num_redundant_experts) if getattr(par, "enable_eplb", False) else 0


def live_eplb_map(model: torch.nn.Module, rows: int, experts: int, redundant: int) -> list[list[int]]:
    """The physical -> logical expert map vLLM holds now, one row per MoE layer (the layout's
    `EPLB` table). vLLM's EplbState gives each MoE layer views of its `logical_to_physical_map`
    ([E, max replicas], -1 padded) and `logical_replica_count` ([E]), updated in place on
    every rebalance (`MixtureOfExperts.set_eplb_state`); each physical slot is the copy of
    exactly one logical expert. Before that state is set, the slots hold what vLLM loaded
    them with: its initial map (slot p: expert p mod E). Raises EngineRefused where the state
    is not a map of the P = E + R slots."""
    from vllm.model_executor.models.interfaces import get_mixture_of_experts_model

    from layoutlang.bridges.families import vllm_initial_eplb_map

    moe = get_mixture_of_experts_model(model)
    layers = list(getattr(moe, "moe_layers", None) or [])
    if len(layers) != rows:
        raise EngineRefused(f"EPLB: the model has {len(layers)} MoE layers, the layout's EPLB table {rows} rows")
    physical = experts + redundant
    out = []
    for i, layer in enumerate(layers):
        state = getattr(layer, "eplb_state", None)
        l2p = getattr(state, "logical_to_physical_map", None)
        count = getattr(state, "logical_replica_count", None)
        if l2p is None or count is None:
            out.append(list(vllm_initial_eplb_map(experts, redundant)))
            continue
        l2p, count = l2p.cpu().tolist(), count.cpu().tolist()
        row = [-1] * physical
        for e in range(experts):
            for p in l2p[e][:count[e]]:
                if not 0 <= p < physical or row[p] != -1:
                    raise EngineRefused(f"EPLB: MoE layer {i}'s map puts logical expert {e} in physical slot {p}, "
                                        f"which is {'out of range' if not 0 <= p < physical else 'taken'} "
                                        f"({physical} slots)")
                row[p] = e
        if -1 in row:
            raise EngineRefused(f"EPLB: MoE layer {i}'s map leaves physical slot {row.index(-1)} without a "
                                "logical expert")
        out.append(row)
    return out


def _routed_maps(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Each FusedMoE's global -> local expert map on this rank (-1: held elsewhere), by module path."""
    return {path: module.expert_map.cpu() for path, module in model.named_modules()
            if type(module).__name__.endswith("RoutedExperts") and getattr(module, "expert_map", None) is not None}


def _layout_map(layout, name: str, rank: int, total: int) -> torch.Tensor | None:
    """The expert map a layout says rank `rank` holds for the stacked tensor `name`: its stacked
    dim's runs (local index -> expert), written as vLLM writes its map. None: no such tensor."""
    t = next((t for t in layout.tensors if t.name == name and t.holds(rank)), None)
    if t is None:
        return None
    out = torch.full((total,), -1, dtype=torch.int32)
    for run in t.runs(rank)[0]:
        out[run.logical_start:run.logical_start + run.length] = torch.arange(
            run.local_start, run.local_start + run.length, dtype=torch.int32)
    return out


def _expert_placement(vllm_config, model: torch.nn.Module, rank: int) -> tuple[str, list[str]]:
    """(vLLM's expert placement, problems): the placement whose layout holds, on this rank, exactly
    the experts vLLM's own expert maps place here; problems name each map no layout describes."""
    maps = _routed_maps(model)
    if not maps:
        return "linear", []
    for placement in VLLM_EXPERT_PLACEMENTS:
        layout = loads(replica_layout(vllm_config, placement), LAYOUT_PATH)
        if all((m := _layout_map(layout, f"{path}.w13_weight", rank, int(emap.numel()))) is not None
               and torch.equal(m, emap.to(torch.int32)) for path, emap in maps.items()):
            return placement, []
    return "linear", [f"`{path}`: vLLM placed experts {emap.tolist()} (global -> local) on this rank, which "
                      f"neither the linear nor the round_robin layout describes" for path, emap in maps.items()]


# ---- worker side ------------------------------------------------------------------------------

class LayoutlangEngine(WeightTransferEngine[LayoutlangInitInfo, LayoutlangUpdateInfo]):
    """vLLM's worker-side engine: this worker is one rank of one EngineJob replica."""

    init_info_cls = LayoutlangInitInfo
    update_info_cls = LayoutlangUpdateInfo
    supports_draft_weight_update = False

    def __init__(self, config, vllm_config, device, model) -> None:
        super().__init__(config, vllm_config, device, model)
        self.job: EngineJob | None = None
        self.live: LiveModel | None = None
        self.text: str | None = None
        self.eplb: list[list[int]] | None = None   # the expert map the job's layout holds (EPLB on)

    @property
    def rank(self) -> int:
        from vllm.distributed import get_tensor_model_parallel_rank
        return get_tensor_model_parallel_rank()

    def init_transfer_engine(self, init_info: LayoutlangInitInfo) -> None:
        placement, problems = _expert_placement(self.vllm_config, self.model, self.rank)
        if not problems:  # (a placement the layout cannot say is the reason, not the layout's error)
            self.text = replica_layout(self.vllm_config, placement)
            layout = loads(self.text, LAYOUT_PATH)
            self.eplb = self._live_map(layout)
            if self.eplb is not None:  # the slots as vLLM fills them now: the job plans for this map
                layout = loads(self.text, LAYOUT_PATH, {"EPLB": self.eplb})
            live = LiveModel.of(self.model, self.device.type == "cpu")
            problems = live_problems(layout, self.rank, live)
        if problems:
            raise EngineRefused(f"vLLM worker {self.rank}: the live model is not the layout it would be refit as, "
                                "nothing was moved:\n  " + "\n  ".join(problems[:12]))
        self.live = live
        self.job = EngineJob(layout, address=init_info.address, replica=init_info.replica, rank=self.rank,
                             world_size=layout.ranks, timeout=timedelta(seconds=init_info.timeout),
                             connect_timeout=None if init_info.connect_timeout is None
                             else timedelta(seconds=init_info.connect_timeout))

    def start_weight_update(self) -> None:
        job = self._need_job()  # raises before anything moves
        if self.eplb is not None:  # EPLB rebalanced since the last refit: the trainer plans the new map
            now = self._live_map(job.one)
            if now != self.eplb:
                job.set_args({"EPLB": now})
                self.eplb = now
        self.live.enter()

    def _live_map(self, layout) -> list[list[int]] | None:
        """vLLM's physical -> logical expert map now (None with EPLB off), shaped as `layout`'s table."""
        redundant = redundant_experts(self.vllm_config)
        if not redundant:
            return None
        table = dict(layout.args).get("EPLB")
        if table is None:
            raise EngineRefused("EPLB is on but the layout has no `EPLB` table (a model without routed experts?)")
        return live_eplb_map(self.model, len(table), len(table[0]) - redundant, redundant)

    def update_weights(self, update_info: dict[str, Any]) -> None:
        """vLLM's default synchronizes the accelerator unguarded; on CPU there is none."""
        self.receive_weights(self.parse_update_info(update_info))
        if self.device.type != "cpu":
            torch.accelerator.synchronize()

    def receive_weights(self, update_info: LayoutlangUpdateInfo) -> None:
        job = self._need_job()
        if not self.live.entered:
            raise EngineRefused("receive_weights before start_weight_update")
        try:
            version = job.receive(self.live.tensors(), wait=update_info.wait)
        except RefitError:
            self.live.leave(self.model_config.dtype, keep=False)
            raise
        if update_info.version is not None and version != update_info.version:
            self.live.leave(self.model_config.dtype, keep=False)
            raise EngineRefused(f"received version {version!r}, expected {update_info.version!r}")

    def finish_weight_update(self) -> None:
        if self.live is not None:
            self.live.leave(self.model_config.dtype, keep=True)

    @property
    def version(self):
        return None if self.job is None else self.job.version

    def shutdown(self) -> None:
        if self.job is not None:
            self.job.close()
            self.job = None

    def _need_job(self) -> EngineJob:
        if self.job is None or self.live is None:
            raise EngineRefused("init_transfer_engine has not run on this worker")
        return self.job


# ---- trainer side -----------------------------------------------------------------------------

@dataclass
class LayoutlangTrainerInitInfo(TrainerInitInfo):
    """Every trainer rank: its layout, the engines' (`vllm.engine_layout` of their config), the job."""

    backend = BACKEND
    train: str = ""                   # the trainer's layout: a path
    infer: str = ""                   # the engine replica's layout TEXT (engine_layout)
    address: str = ""                 # HOST:PORT the trainer job's rank 0 hosts
    world_size: int = 1
    replica: str = "vllm-0"           # the replica id of the vLLM engine this client drives
    timeout: float = 60.0
    train_args: dict = field(default_factory=dict)


@dataclass
class LLMClient:
    """vLLM's trainer-side client protocol over an in-process `vllm.LLM`: its RL entry points
    (`RLOfflineMixin`) take vLLM's request objects, which is what `RayVLLMWeightSyncClient`
    sends an `LLM` in a Ray actor; this sends the same, in process."""

    llm: Any

    def init_weight_transfer_engine(self, init_info: dict) -> None:
        self.llm.init_weight_transfer_engine(WeightTransferInitRequest(init_info=init_info))

    def start_weight_update(self) -> None:
        self.llm.start_weight_update()

    def update_weights(self, update_info) -> None:
        self.llm.update_weights(WeightTransferUpdateRequest(update_info=update_info))

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self.llm.finish_weight_update(weight_version)

    def shutdown_weight_transfer_engine(self) -> None:  # as vLLM's HTTP and Ray clients have it
        self.llm.shutdown_weight_transfer_engine()


def sync_client(client):
    """`client` as a `VLLMWeightSyncClient` (init info and update payload as they are): an
    in-process `vllm.LLM` (anything with its RL entry points) wrapped in `LLMClient`,
    anything else (vLLM's HTTP / Ray clients, a user's) as it is."""
    from vllm.entrypoints.rl.offline import RLOfflineMixin

    return LLMClient(client) if isinstance(client, RLOfflineMixin) else client


class LayoutlangTrainer(TrainerWeightTransferEngine[LayoutlangTrainerInitInfo]):
    """A TrainerJob on every trainer rank; rank 0 drives vLLM's update flow around each refit."""

    init_info_cls = LayoutlangTrainerInitInfo

    @classmethod
    def trainer_init(cls, init_info: LayoutlangTrainerInitInfo, *, client, source=None):
        client = sync_client(client)
        self = cls(client=client, source=source, is_sender=init_info.rank == 0, rank=init_info.rank)
        self.info = init_info
        self.job = TrainerJob(init_info.train, loads(init_info.infer, LAYOUT_PATH), address=init_info.address,
                              rank=init_info.rank, world_size=init_info.world_size,
                              timeout=timedelta(seconds=init_info.timeout), src_args=init_info.train_args)
        self.step = 0
        if self.is_sender:  # the worker's LayoutlangInitInfo, as the client protocol takes it
            client.init_weight_transfer_engine({"address": init_info.address, "replica": init_info.replica,
                                                "timeout": init_info.timeout})
        return self

    def send_weights(self, tensors=None, version=None):
        """One refit of `tensors` (default: the `source` given at init: a mapping, or a callable
        returning one) as `version` (default: a step count); returns the JobReport."""
        self.step += 1
        version = self.step if version is None else version
        tensors = tensors if tensors is not None else (self.source() if callable(self.source) else self.source)
        if not self.is_sender:
            return self.job.refit(tensors, version)
        self.client.start_weight_update()
        failed: list[BaseException] = []

        def update() -> None:
            try:
                self.client.update_weights({"version": version})  # the worker's LayoutlangUpdateInfo
            except BaseException as exc:  # noqa: BLE001 - reported after the refit
                failed.append(exc)

        worker = threading.Thread(target=update, name="layoutlang-vllm-update", daemon=True)
        worker.start()
        report = self.job.refit(tensors, version, expect=(self.info.replica,))
        worker.join(self.info.timeout + 5)
        if failed:
            raise failed[0]
        self.client.finish_weight_update(weight_version=str(version))
        return report

    def shutdown(self) -> None:
        self.job.close()
