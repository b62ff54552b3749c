"""What every engine integration checks before a byte moves: the live model against its layout.

An engine's worker holds its parameters in its own storage; a refit writes that storage
directly, so the layout it is planned into must be exactly what the worker holds: every
live parameter covered (else it stays stale), every layout tensor a live parameter, and
each one's local shape, dtype and strides the layout's on this rank. Imports no engine:
the vLLM backend (vllm_engine.py) and the SGLang loader (sglang.py) share it.

>>> import torch
>>> from layoutlang import loads
>>> layout = loads("mesh e (tp=2)\\ntensor w [4 over tp, 2] fp32\\n")
>>> live = DirectModel.of(torch.nn.ParameterDict({"w": torch.nn.Parameter(torch.zeros(2, 3))}))
>>> live_problems(layout, 0, live)
['`w`: the layout says [2, 2] fp32, the engine holds [2, 3] float32']
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from layoutlang.diagnostics import UsageError

_DTYPE = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


class EngineRefused(UsageError):
    """The live model cannot be refit as described: nothing was moved."""


def replica_text(hf_config, convention: str, *, engine: str, dtype: str, tp: int, ep: int = 1,
                 expert_placement: str = "linear", redundant_experts: int = 0) -> str:
    """The layout text of one engine replica of TP `tp` ranks (`layoutc new CONVENTION`) from the
    config.json the engine read, in the engine's storage dtype (a torch dtype name);
    `redundant_experts` > 0: an EPLB engine's (its physical expert map the table arg `EPLB`)."""
    from layoutlang.bridges.families import model_from_config, render
    from layoutlang.bridges.model import DTYPES

    if dtype not in DTYPES:
        raise EngineRefused(f"{engine} runs this model in {dtype}, which no layout dtype describes")
    config = dict(hf_config, dtype=dtype)
    config.pop("torch_dtype", None)
    model = model_from_config(config, source=f"{engine}'s model config")
    sizes = {"TP": tp, "DP": 1}
    if model.moe is not None:
        sizes["EP"] = ep
    return render(model, convention, sizes, expert_placement, redundant_experts)


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


@dataclass
class DirectModel:
    """A model whose parameters are written where they live (no post-load repacking): the
    destinations are its parameters by name; `refused` says which modules cannot be so."""

    model: torch.nn.Module
    direct: dict[str, torch.Tensor] = field(default_factory=dict)
    refused: list[str] = field(default_factory=list)

    @classmethod
    def of(cls, model: torch.nn.Module, refuse=lambda path, module: None) -> "DirectModel":
        """Every parameter under its first name (a tied one once); `refuse(path, module)` returns
        why a module's storage is not what it loaded (then its parameters are not written)."""
        live = cls(model)
        seen: set[int] = set()
        for path, module in model.named_modules():
            own = [(n, p) for n, p in module.named_parameters(recurse=False) if id(p) not in seen]
            if not own:
                continue
            seen.update(id(p) for _, p in own)
            reason = refuse(path, module)
            if reason is not None:
                live.refused.append(f"`{path}`: {reason}")
                continue
            for name, p in own:
                live.direct[f"{path}.{name}" if path else name] = p
        return live

    def loaded_shapes(self) -> dict[str, tuple[torch.Size, torch.dtype]]:
        return {n: (p.shape, p.dtype) for n, p in self.direct.items()}

    def tensors(self) -> dict[str, torch.Tensor]:
        return dict(self.direct)


def live_problems(layout, rank: int, live, engine: str = "the engine") -> list[str]:
    """Why the layout is not the live model on this rank (names, shapes, dtypes, strides).
    `live`: anything with `refused`, `direct` and `loaded_shapes()` (DirectModel, vLLM's LiveModel)."""
    problems = list(live.refused)
    want = {t.name: t for t in layout.tensors if t.holds(rank)}
    have = live.loaded_shapes()
    for name in sorted(set(have) - set(want)):
        problems.append(f"live parameter `{name}` {list(have[name][0])} is not in the layout: a refit would leave "
                        "it stale")
    for name, t in want.items():
        if name not in have:
            problems.append(f"layout tensor `{name}` is not a parameter of the live model")
            continue
        shape, dtype = have[name]
        expected = tuple(t.local_shape_at(rank))
        if tuple(shape) != expected or dtype != _DTYPE.get(t.dtype):
            problems.append(f"`{name}`: the layout says {list(expected)} {t.dtype}, {engine} holds {list(shape)} "
                            f"{dtype_name(dtype)}")
        elif name in live.direct and not live.direct[name].is_contiguous():
            problems.append(f"`{name}`: {engine} holds it with strides {live.direct[name].stride()}, not contiguous "
                            f"as the layout describes")
    return problems


__all__ = ["EngineRefused", "DirectModel", "live_problems", "replica_text", "dtype_name"]
