"""layoutlang inside SGLang: a `--custom-weight-loader` that refits each TP worker's live parameters.

SGLang updates a running engine's weights with `update_weights_from_tensor(named_tensors,
load_format=NAME)` (the Engine API or the HTTP route); when NAME is one of the server's
`--custom-weight-loader` functions, every TP worker calls `NAME(model, named_tensors)` with
its live model and waits for all of them to return. Here NAME is `load_weights` (LOADER),
and the named tensors are not weights but one control message (a JSON object in a uint8
tensor, `message`): `init` joins the trainer job as one `EngineJob` replica (the worker's
TP rank its rank), `update` takes one refit straight into the live parameters, `close`
leaves. The weights themselves never pass through SGLang's serializer: each worker receives
its own slices from the trainer ranks that hold them (docs/jobs.md).

Before joining, the worker writes its layout from the model's own config (`engine_layout`:
`layoutc new sglang`'s convention) and checks it against `model.named_parameters()` (live.py:
names, shapes, dtypes, strides); a module whose storage is not what it loaded is refused,
naming it: a quantization method other than SGLang's unquantized ones, SGLang's CPU backend
(it repacks weights with AMX after loading) and AITER (`SGLANG_USE_AITER`: shuffled
weights). Nothing is moved then.

Trainer side, `SGLangTrainer`: a `TrainerJob` on every trainer rank; rank 0 sends the
control messages through `update` (a callable: `engine_update(engine)` for an in-process
`sglang.Engine`, or the caller's HTTP post), the `update` message concurrently with the refit.

SGLang (0.5.23) does not import on the machines this is built on: the worker code is tested
on hand-built models that store their weights as SGLang's rules say (tests/test_sglang.py),
with the messages carried as SGLang carries them (every worker runs the loader, the call
returns when all have); SGLang itself is not in the tests (docs/engines.md). This module
imports SGLang only inside `_parallel`.

>>> kind, fields = read_message(message("update", version=3))
>>> kind, fields
('update', {'version': 3})
"""

from __future__ import annotations

import json
import os
import threading
import weakref
from collections import Counter
from collections.abc import Callable, Mapping
from datetime import timedelta

import torch

from .live import DirectModel, EngineRefused, dtype_name, live_problems, replica_text

LOADER = "layoutlang.integrations.sglang.load_weights"   # the --custom-weight-loader name
LAYOUT_PATH = "sglang-replica.layout"   # the engine layout's name on both sides (its digest covers it)
PREFIX = "layoutlang."                  # a control message's name: PREFIX + kind
KINDS = ("init", "update", "close")
# SGLang's quantization methods that keep the loaded storage on a GPU (no post-load repacking)
DIRECT_METHODS = frozenset({"UnquantizedLinearMethod", "UnquantizedEmbeddingMethod", "UnquantizedFusedMoEMethod"})


# ---- the control messages -----------------------------------------------------------------------

def message(kind: str, **fields) -> list[tuple[str, torch.Tensor]]:
    """The named tensors of one control message: what `update_weights_from_tensor` carries."""
    if kind not in KINDS:
        raise ValueError(f"unknown message kind {kind!r}: expected one of {', '.join(KINDS)}")
    data = json.dumps(fields, sort_keys=True).encode()
    return [(PREFIX + kind, torch.frombuffer(bytearray(data), dtype=torch.uint8))]


def read_message(named_tensors) -> tuple[str, dict]:
    """(kind, fields) of the named tensors SGLang handed the loader, or EngineRefused saying why
    they are not one layoutlang message (weights sent with load_format=LOADER are refused:
    this loader takes its weights from the trainer job, never from the call)."""
    named = list(named_tensors)
    names = [n for n, _ in named]
    if len(named) != 1 or not names[0].startswith(PREFIX) or names[0][len(PREFIX):] not in KINDS:
        shown = ", ".join(names[:4]) + (", ..." if len(names) > 4 else "")
        raise EngineRefused(f"load_format={LOADER} got tensors [{shown}], not one layoutlang message "
                            f"({', '.join(PREFIX + k for k in KINDS)}): its weights come from the trainer job",
                            help="send `layoutlang.integrations.sglang.message(...)`, or use SGLang's default "
                                 "load_format for plain tensors")
    tensor = named[0][1]
    if not isinstance(tensor, torch.Tensor) or tensor.dtype != torch.uint8 or tensor.dim() != 1:
        raise EngineRefused(f"`{names[0]}`: expected a 1-D uint8 tensor of JSON")
    try:
        fields = json.loads(bytes(tensor.cpu().numpy().tobytes()).decode())
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise EngineRefused(f"`{names[0]}`: not JSON ({exc})") from None
    if not isinstance(fields, dict):
        raise EngineRefused(f"`{names[0]}`: expected a JSON object, got {type(fields).__name__}")
    return names[0][len(PREFIX):], fields


# ---- the worker side ----------------------------------------------------------------------------

def engine_layout(hf_config: Mapping, *, dtype: str, tp: int, ep: int = 1) -> str:
    """The layout of one SGLang replica of TP `tp` ranks (MoE experts over `ep` of them within
    the TP group, 1: each expert split over all `tp`), in SGLang's storage of `dtype` (a torch
    dtype name such as "bfloat16")."""
    return replica_text(hf_config, "sglang", engine="SGLang", dtype=dtype, tp=tp, ep=ep)


def _parallel() -> tuple[int, int, int]:
    """(TP rank, TP size, MoE EP size) of this SGLang worker, from SGLang's parallel state."""
    from sglang.srt.distributed import get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size

    try:
        from sglang.srt.layers.moe import get_moe_expert_parallel_world_size
        ep = get_moe_expert_parallel_world_size()
    except ImportError:  # an SGLang without expert parallelism in its MoE package
        ep = 1
    return get_tensor_model_parallel_rank(), get_tensor_model_parallel_world_size(), ep


def _storage_refused(on_cpu: bool) -> Callable:
    """`DirectModel.of`'s test: why a module's live storage is not the format it loaded."""
    aiter = os.environ.get("SGLANG_USE_AITER", "0").lower() in ("1", "true")

    def refuse(path: str, module: torch.nn.Module) -> str | None:
        method = getattr(module, "quant_method", None)
        if method is None:
            return None
        kind = type(method).__name__
        if kind not in DIRECT_METHODS:
            return f"quantization method {kind} stores kernel-format weights that no layout here describes"
        if on_cpu:
            return f"SGLang's CPU backend repacks {kind} weights (AMX) after loading: not the layout's storage"
        if aiter:
            return f"SGLANG_USE_AITER is on: {kind} weights are shuffled after loading, not the layout's storage"
        return None

    return refuse


def _model_dtype(model: torch.nn.Module) -> str:
    """The dtype most of the model's parameter elements have (SGLang's `--dtype`)."""
    counts = Counter()
    for p in model.parameters():
        counts[p.dtype] += p.numel()
    return dtype_name(counts.most_common(1)[0][0]) if counts else "bfloat16"


class _Worker:
    """One TP worker's membership: its layout, its live parameters, its EngineJob."""

    def __init__(self, model: torch.nn.Module, fields: dict, rank: int, tp: int, ep: int):
        from layoutlang.elaborate import loads
        from layoutlang.runtime import EngineJob

        config = getattr(model, "config", None)
        if config is None:
            raise EngineRefused(f"SGLang worker {rank}: the model has no `config` to write its layout from")
        hf = config.to_dict() if hasattr(config, "to_dict") else dict(config)
        self.rank = rank
        self.text = engine_layout(hf, dtype=fields.get("dtype") or _model_dtype(model), tp=tp, ep=ep)
        layout = loads(self.text, LAYOUT_PATH)
        on_cpu = any(p.device.type == "cpu" for p in model.parameters())
        self.live = DirectModel.of(model, _storage_refused(on_cpu))
        problems = live_problems(layout, rank, self.live, "SGLang")
        if problems:
            raise EngineRefused(f"SGLang worker {rank}: the live model is not the layout it would be refit as, "
                                "nothing was moved:\n  " + "\n  ".join(problems[:12]))
        if "address" not in fields:
            raise EngineRefused("the init message has no `address` (the trainer job's HOST:PORT)")
        connect = fields.get("connect_timeout")
        self.job = EngineJob(layout, address=fields["address"], replica=fields.get("replica", "sglang-0"), rank=rank,
                             world_size=layout.ranks, timeout=timedelta(seconds=float(fields.get("timeout", 60.0))),
                             connect_timeout=None if connect is None else timedelta(seconds=float(connect)))

    def update(self, fields: dict):
        wait = fields.get("wait")
        version = self.job.receive(self.live.tensors(), wait=None if wait is None else float(wait))
        if fields.get("version") is not None and version != fields["version"]:
            raise EngineRefused(f"SGLang worker {self.rank}: received version {version!r}, expected "
                                f"{fields['version']!r}")
        return version

    def close(self) -> None:
        self.job.close()


_WORKERS: "weakref.WeakKeyDictionary[torch.nn.Module, _Worker]" = weakref.WeakKeyDictionary()


def load_weights(model: torch.nn.Module, named_tensors) -> None:
    """SGLang's custom weight loader (`--custom-weight-loader` LOADER): run one control message
    on this TP worker. Raises EngineRefused (nothing moved) or RefitError (docs/jobs.md)."""
    kind, fields = read_message(named_tensors)
    worker = _WORKERS.get(model)
    if kind == "init":
        if worker is not None:
            worker.close()
            del _WORKERS[model]
        _WORKERS[model] = _Worker(model, fields, *_parallel())
        return
    if worker is None:
        raise EngineRefused(f"`{PREFIX}{kind}` before `{PREFIX}init` on this worker")
    if kind == "update":
        worker.update(fields)
    else:
        worker.close()
        del _WORKERS[model]


# ---- the trainer side ---------------------------------------------------------------------------

def engine_update(engine) -> Callable:
    """`update` for an in-process `sglang.Engine`: its `update_weights_from_tensor` with LOADER."""
    return lambda named: engine.update_weights_from_tensor(named, load_format=LOADER)


def _check_reply(kind: str, reply) -> None:
    """SGLang answers (success, message) (the Engine) or {"success": ..., "message": ...} (HTTP)."""
    ok, text = None, ""
    if isinstance(reply, tuple) and reply and isinstance(reply[0], bool):
        ok, text = reply[0], (reply[1] if len(reply) > 1 else "")
    elif isinstance(reply, Mapping) and isinstance(reply.get("success"), bool):
        ok, text = reply["success"], reply.get("message", "")
    if ok is False:
        raise EngineRefused(f"SGLang refused `{PREFIX}{kind}`: {text}")


class SGLangTrainer:
    """A TrainerJob on every trainer rank; rank 0 drives the SGLang replica through `update`
    (named tensors -> SGLang's reply; `engine_update(engine)` or an HTTP post)."""

    def __init__(self, train, infer: str, *, address: str, rank: int, world_size: int, update: Callable | None = None,
                 replica: str = "sglang-0", timeout: float = 60.0, train_args: dict | None = None, **job_options):
        from layoutlang.elaborate import loads
        from layoutlang.runtime import TrainerJob

        if rank == 0 and update is None:
            raise ValueError("trainer rank 0 drives the engine: pass `update`")
        self.rank, self.replica, self.timeout, self.update = rank, replica, timeout, update
        self.job = TrainerJob(train, loads(infer, LAYOUT_PATH), address=address, rank=rank, world_size=world_size,
                              timeout=timedelta(seconds=timeout), src_args=train_args, **job_options)
        self.step = 0
        if rank == 0:
            self._send("init", address=address, replica=replica, timeout=timeout)

    def _send(self, kind: str, **fields) -> None:
        _check_reply(kind, self.update(message(kind, **fields)))

    def send_weights(self, tensors, version=None):
        """One refit of `tensors` as `version` (default: a step count); returns the JobReport."""
        self.step += 1
        version = self.step if version is None else version
        if self.rank != 0:
            return self.job.refit(tensors, version)
        failed: list[BaseException] = []

        def update() -> None:
            try:
                self._send("update", version=version, wait=self.timeout)
            except BaseException as exc:  # noqa: BLE001 - reported after the refit
                failed.append(exc)

        worker = threading.Thread(target=update, name="layoutlang-sglang-update", daemon=True)
        worker.start()
        report = self.job.refit(tensors, version, expect=(self.replica,))
        worker.join(self.timeout + 5)
        if failed:
            raise failed[0]
        return report

    def close(self) -> None:
        try:
            if self.rank == 0:
                self._send("close")
        finally:
            self.job.close()


__all__ = ["LOADER", "message", "read_message", "engine_layout", "load_weights", "engine_update", "SGLangTrainer"]
