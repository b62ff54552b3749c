"""`layoutc new vllm --redundant-experts R`: an EPLB engine's layout, its experts placed by a table.

vLLM's EPLB keeps E + R physical experts per MoE layer; slot p holds a copy of logical expert
`physical_to_logical_map[layer][p]`, first `list(range(E)) + [i % E for i in range(R)]`
(vLLM's EplbState.build_initial_global_physical_to_logical_map), and the slots are placed over
the EP ranks as its expert map places experts (linear: the first P mod EP ranks one more).
Every expected value below is computed here from those written rules and from the HF tensors
the test makes, never from the generated layout."""

from __future__ import annotations

import json
import random

import pytest
import torch

from layoutlang import compile_plan, loads
from layoutlang.bridges.families import layout_text
from layoutlang.cli import main
from layoutlang.compiler.tables import TablePlanner
from layoutlang.runtime import loopback
from test_layoutc_new import CONFIGS
from test_table_planner import same_plan

EP = 2


def _configs():
    # qwen3_moe: every layer routed; deepseek_v3: two dense layers first (table row = layer - 2)
    return {name: (CONFIGS[name], first) for name, first in (("qwen3_moe", 0), ("deepseek_v3", 2))}


def _experts(cfg: dict) -> int:
    return cfg.get("num_experts") or cfg.get("n_routed_experts")


def _engine_text(cfg: dict, redundant: int, placement: str = "linear") -> str:
    return layout_text(cfg, "vllm", {"TP": EP, "EP": EP, "AT": 1}, placement, redundant)


def _map(seed: int, layers: int, experts: int, redundant: int) -> list[list[int]]:
    rng = random.Random(seed)
    out = []
    for _ in range(layers):
        slots = list(range(experts)) + [rng.randrange(experts) for _ in range(redundant)]
        rng.shuffle(slots)
        out.append(slots)
    return out


def _linear_slots(physical: int, ranks: int) -> list[list[int]]:
    """vLLM's linear expert map over `physical` slots: q = P // ranks, the first P mod ranks one more."""
    q, r = divmod(physical, ranks)
    out, at = [], 0
    for c in range(ranks):
        n = q + (c < r)
        out.append(list(range(at, at + n)))
        at += n
    return out


def _refit(cfg: dict, engine_text: str, args=None):
    """The HF checkpoint layout of `cfg` (rank 0, random tensors) into the engine (ranks 1..EP)."""
    src_layout = loads(layout_text(cfg, "hf"), "hf.layout")
    dst_layout = loads(engine_text, "engine.layout", args)
    plan = compile_plan(src_layout, dst_layout)
    gen = torch.Generator().manual_seed(0)
    assert {t.dtype for t in src_layout.tensors + dst_layout.tensors} == {"fp32"}  # (CONFIGS: float32)
    hf = {t.name: torch.randn(t.local_shape_at(0), generator=gen) for t in src_layout.tensors}
    dst = {r: {} for r in range(plan.world)}
    for t in plan.dst.tensors:
        for r in t.ranks():
            dst[r][t.name] = torch.full(t.local_shape_at(r), float("nan"))
    loopback.refit(plan, {0: hf, **{r: {} for r in range(1, plan.world)}}, dst)
    return plan, hf, dst


def _check_slots(cfg: dict, first: int, hf: dict, dst: dict, emap, physical: int) -> None:
    """Slot j of engine rank c (rank 1 + c) holds logical expert emap[l - first][p]: w13 its gate
    rows then its up rows, w2 its down_proj; p = the j-th slot vLLM's linear map gives rank c."""
    for c, slots in enumerate(_linear_slots(physical, EP)):
        for l in range(first, cfg["num_hidden_layers"]):
            pre = f"model.layers.{l}.mlp.experts"
            w13, w2 = dst[1 + c][f"{pre}.routed_experts.w13_weight"], dst[1 + c][f"{pre}.routed_experts.w2_weight"]
            assert w13.shape[0] == len(slots), (c, l)
            for j, p in enumerate(slots):
                e = emap[l - first][p]
                gate_up = torch.cat([hf[f"{pre}.{e}.gate_proj.weight"], hf[f"{pre}.{e}.up_proj.weight"]])
                assert torch.equal(w13[j], gate_up), (c, l, p, e)
                assert torch.equal(w2[j], hf[f"{pre}.{e}.down_proj.weight"]), (c, l, p, e)


@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3"])
def test_the_default_map_is_vllms_initial_one_and_every_slot_gets_its_expert(family):
    cfg, first = _configs()[family]
    experts, redundant = _experts(cfg), 3  # P = E + 3: uneven over EP=2 (the linear map's extra slot)
    physical = experts + redundant
    initial = [p % experts for p in range(physical)]  # vLLM: range(E), then i % E for the R copies
    text = _engine_text(cfg, redundant)
    layers = cfg["num_hidden_layers"] - first
    assert dict(loads(text, "engine.layout").args)["EPLB"] == tuple(tuple(initial) for _ in range(layers))
    _, hf, dst = _refit(cfg, text)
    _check_slots(cfg, first, hf, dst, [initial] * layers, physical)


@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3"])
def test_a_rebalanced_map_refits_exactly_and_re_plans_on_the_fast_path(family):
    cfg, first = _configs()[family]
    experts, redundant = _experts(cfg), 2
    physical, layers = experts + redundant, cfg["num_hidden_layers"] - first
    text = _engine_text(cfg, redundant)
    emap = _map(7, layers, experts, redundant)
    plan, hf, dst = _refit(cfg, text, {"EPLB": emap})
    _check_slots(cfg, first, hf, dst, emap, physical)
    # the generated layout reads its table only as whole key interpolations: re-keyed, not elaborated
    src = loads(layout_text(cfg, "hf"), "hf.layout")
    planner = TablePlanner(src, text, "EPLB", dst_path="engine.layout")
    assert planner.rekeyable, planner.reason
    same_plan(planner.plan(emap), plan)
    again = _map(8, layers, experts, redundant)
    same_plan(planner.plan(again), compile_plan(src, loads(text, "engine.layout", {"EPLB": again})))


def test_round_robin_places_the_physical_slots_cyclically():
    cfg, first = _configs()["qwen3_moe"]
    experts, redundant = _experts(cfg), 2
    emap = _map(3, cfg["num_hidden_layers"], experts, redundant)
    _, hf, dst = _refit(cfg, _engine_text(cfg, redundant, "round_robin"), {"EPLB": emap})
    for c in range(EP):
        slots = list(range(c, experts + redundant, EP))  # vLLM round_robin: rank c holds c, c + EP, ...
        for l in range(cfg["num_hidden_layers"]):
            w2 = dst[1 + c][f"model.layers.{l}.mlp.experts.routed_experts.w2_weight"]
            for j, p in enumerate(slots):
                assert torch.equal(w2[j], hf[f"model.layers.{l}.mlp.experts.{emap[l][p]}.down_proj.weight"])


@pytest.mark.parametrize("argv, message", [
    (["sglang", "--redundant-experts", "2"], "error: redundant experts are vLLM's EPLB; the sglang layout has none"),
    (["vllm", "--redundant-experts", "-1"], "error: redundant experts -1: expected an integer >= 0"),
])
def test_redundant_experts_outside_vllms_eplb_are_usage_errors(tmp_path, capsys, argv, message):
    config = tmp_path / "config.json"
    config.write_text(json.dumps(CONFIGS["qwen3_moe"]))
    assert main(["new", argv[0], "--config", str(config), *argv[1:]]) == 2
    assert capsys.readouterr().err.splitlines()[0] == message


def test_a_dense_model_has_no_experts_to_make_redundant(tmp_path, capsys):
    config = tmp_path / "config.json"
    config.write_text(json.dumps(CONFIGS["llama"]))
    assert main(["new", "vllm", "--config", str(config), "--redundant-experts", "2"]) == 2
    assert capsys.readouterr().err.splitlines()[0] == "error: redundant experts: llama has no routed experts"


def test_the_cli_writes_the_table_and_summarises_it(tmp_path, capsys):
    config, out = tmp_path / "config.json", tmp_path / "engine.layout"
    config.write_text(json.dumps(CONFIGS["qwen3_moe"]))
    assert main(["new", "vllm", "--config", str(config), "--set", "TP=2", "--set", "EP=2",
                 "--redundant-experts", "2", "-o", str(out)]) == 0
    assert "EPLB=[2 x 6 table]" in capsys.readouterr().out  # 2 MoE layers x (4 experts + 2)
    assert "arg EPLB = [[0, 1, 2, 3, 0, 1], [0, 1, 2, 3, 0, 1]]" in out.read_text().splitlines()
    assert main(["fmt", "--check", str(out)]) == 0
