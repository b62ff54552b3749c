"""The `layoutlang` weight-transfer backend for vLLM: registration and the engine's layout.

vLLM (0.16 and later) picks a weight-transfer backend by name
(`--weight-transfer-config '{"backend": "layoutlang"}'`) from two registries,
`WeightTransferEngineFactory` (worker side) and `WeightTransferTrainerFactory` (trainer
side). `register` puts this package's classes in both; vLLM calls it in every process
(driver, engine core, each worker, before the model loads) through the
`vllm.general_plugins` entry point that pyproject.toml declares, so installing
`layoutlang[vllm]` is all a deployment needs. A name registered already (the plugin loaded
twice, or by hand) is not an error.

`engine_layout` writes the `.layout` text of what one vLLM replica holds, from the same
config.json vLLM read and its parallel sizes: `layoutc new vllm`'s convention
(layoutlang/bridges/families.py), checked against the live parameters by the worker before
a byte moves (vllm_engine.py).

This module imports vLLM only inside `register`.
"""

from __future__ import annotations

from collections.abc import Mapping


BACKEND = "layoutlang"
ENGINE = ("layoutlang.integrations.vllm_engine", "LayoutlangEngine")
TRAINER = ("layoutlang.integrations.vllm_engine", "LayoutlangTrainer")


def register() -> None:
    """The `vllm.general_plugins` entry point: the `layoutlang` backend in both factories."""
    from vllm.distributed.weight_transfer import WeightTransferEngineFactory, WeightTransferTrainerFactory

    for factory, (module, name) in ((WeightTransferEngineFactory, ENGINE), (WeightTransferTrainerFactory, TRAINER)):
        if BACKEND not in factory._registry:  # vLLM raises on a second registration of one name
            factory.register_engine(BACKEND, module, name)


def engine_layout(hf_config: Mapping, *, dtype: str, tp: int, ep: int = 1, expert_placement: str = "linear",
                  redundant_experts: int = 0) -> str:
    """The layout of one vLLM replica of TP `tp` ranks (experts over `ep` of them, 1: each
    expert split over all `tp`; placed as vLLM's `expert_placement` map places them), in
    vLLM's storage of `dtype` (a torch dtype name such as "bfloat16", the model's: vLLM may
    run a float32 config in bfloat16). `redundant_experts`: vLLM's EPLB `num_redundant_experts`
    (0: EPLB off); the layout then keys its P = E + R physical slots by the table arg `EPLB`,
    whose default is vLLM's initial map (the engine publishes its live one)."""
    from .live import replica_text

    return replica_text(hf_config, "vllm", engine="vLLM", dtype=dtype, tp=tp, ep=ep, expert_placement=expert_placement,
                        redundant_experts=redundant_experts)
