"""Weights that say which version they are, for the programs of examples/jobs/.

Every logical element of version v is `fill.values(key, index) * (-1)**v * 2**(v % 3)`:
exact in bf16 and fp32 (a sign and a power of two), different in every version
(what a stale element would show), and checkable on an engine rank from its own
layout alone (`layoutlang/runtime/fill.py`: no source, no plan).
"""

from __future__ import annotations

import torch

from layoutlang.runtime.fill import check_destination, empty_destination, source_tensor


def factor(version: int) -> float:
    return (-1.0) ** version * 2.0 ** (version % 3)


def trainer_tensors(layout, rank: int, version: int) -> dict[str, torch.Tensor]:
    """This trainer rank's tensors of `version` (padding NaN: it must never travel)."""
    return {t.name: source_tensor(t, rank) * factor(version) for t in layout.tensors if t.holds(rank)}


def engine_tensors(layout, rank: int) -> dict[str, torch.Tensor]:
    """This engine rank's tensors before any refit: NaN, which no version holds."""
    return {t.name: empty_destination(t, rank=rank) for t in layout.tensors if t.holds(rank)}


def strided(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The same tensors as non-contiguous views (every other element of a buffer twice as long
    in the last dimension): an engine whose parameters are views of a larger storage."""
    out = {}
    for name, value in tensors.items():
        wide = torch.full((*value.shape[:-1], 2 * value.shape[-1]), float("nan"), dtype=value.dtype)
        view = wide[..., ::2]
        view.copy_(value)
        out[name] = view
    return out


def problems(layout, rank: int, tensors: dict, version: int) -> list[str]:
    """Every element checked against `version` (padding must be zero)."""
    out = []
    for t in layout.tensors:
        if t.holds(rank):
            problem = check_destination(t, rank, tensors[t.name] / factor(version))
            if problem:
                out.append(problem)
    return out


def as_parameters(tensors: dict[str, torch.Tensor]) -> tuple[torch.nn.Module, dict[str, torch.nn.Parameter]]:
    """The tensors as a module's parameters (requires_grad), and `dict(module.named_parameters())`:
    what a trainer or an engine hands a refit as it is."""
    root = torch.nn.Module()
    for name, value in tensors.items():
        *path, leaf = name.split(".")
        module = root
        for part in path:
            if not hasattr(module, part):
                module.add_module(part, torch.nn.Module())
            module = getattr(module, part)
        module.register_parameter(leaf, torch.nn.Parameter(value, requires_grad=True))
    return root, dict(root.named_parameters())
