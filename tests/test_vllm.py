"""The `layoutlang` vLLM weight-transfer backend against vLLM 0.33 itself (docs/engines.md).

Each test runs tests/vllm_program.py under .venv-vllm/bin/python (scripts/setup_vllm.sh;
vLLM's Python on CPU, VLLM_TARGET_DEVICE=cpu), the engine and the trainer as separate
process trees with separate worlds: the engine's world is vLLM's own (gloo, one process),
the trainer is a TrainerJob whose rank 0 hosts the store. The oracle is vLLM's own
`load_weights` (inside its layerwise reload, as its nccl backend loads) from the same HF
checkpoint the trainer sends, compared on every parameter and buffer, element by element.
Without .venv-vllm a test skips on a developer's machine and fails in CI (LAYOUTLANG_CI=1).
"""

from __future__ import annotations

import os
import socket
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
import program_runs  # noqa: E402
PROGRAM = ROOT / "tests" / "vllm_program.py"
PYTHON = ROOT / ".venv-vllm" / "bin" / "python"
TIMEOUT = 240


def _python() -> Path:
    if PYTHON.exists():
        return PYTHON
    if os.environ.get("LAYOUTLANG_CI"):
        pytest.fail("no .venv-vllm: scripts/test.sh runs scripts/setup_vllm.sh first")
    pytest.skip("no .venv-vllm (bash scripts/setup_vllm.sh)")


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_all(*commands: list[str]) -> list[list[dict]]:
    """Every command under .venv-vllm at once, one deadline (program_runs.py); each one's JSON lines."""
    env = dict(os.environ, VLLM_TARGET_DEVICE="cpu", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
               PYTHONUNBUFFERED="1")
    return program_runs.run_all(_python(), PROGRAM, list(commands), env=env, cwd=ROOT, timeout=TIMEOUT)


def _steps(lines: list[dict]) -> list[dict]:
    return [x for x in lines if "step" in x]


@pytest.mark.parametrize("arch", ["llama", "qwen3_moe", "deepseek_v3"])
def test_three_refits_equal_vllms_own_load_weights(arch):
    """TP1: every parameter (fused qkv / gate_up, padded vocabulary, routed_experts w13 / w2,
    MLA's derived W_UK_T / W_UV) equals vLLM's own load of the trainer's checkpoint, after
    each of three refits, with no parameter's storage moved."""
    port = _port()
    trainer, engine = run_all(["trainer", arch, str(port)], ["engine", arch, str(port)])
    assert [x["version"] for x in _steps(engine)] == [1, 2, 3]
    assert all(x["differ"] == [] and x["moved_storage"] == [] for x in _steps(engine))
    assert [x["replicas"] for x in _steps(trainer)] == [["vllm-0"]] * 3
    routes = engine[-1]["routes"]
    # on CPU every layer with a quantization method repacks after loading: the reload route
    assert routes["reload"] > 0
    if arch == "deepseek_v3":
        assert routes["derived"] == 2  # one MLA layer per decoder layer recomputes W_UK_T / W_UV


@pytest.mark.parametrize("arch, tp", [("llama", 2), ("llama", 4), ("qwen3_moe_wide", 2), ("qwen3_moe_ep", 2)])
def test_faked_tensor_parallel_ranks(arch, tp):
    """TP faked at 2 and 4 (KV heads replicated at 4; Qwen3-MoE's experts split over TP, or whole
    over EP with --enable-expert-parallel): each worker is one rank of one replica, each checked
    against vLLM's own sliced load."""
    port = _port()
    outs = run_all(["trainer", arch, str(port), str(tp)],
                   *(["engine", arch, str(port), str(tp), str(r)] for r in range(tp)))
    sizes = {x["elements"] for lines in outs[1:] for x in lines if x.get("phase") == "built"}
    # each rank's share, by hand (tests/vllm_models.LLAMA: H 64, 4 q / 2 kv heads of 16, F 128,
    # vocabulary 100 padded to 128, 2 layers): TP2 embed and lm_head 64x64 each, norm 64, per layer
    # qkv 64x64, o 64x32, gate_up 128x64, down 64x64, norms 128; TP4 (one kv head each) 32x64,
    # 32x64, 64 and 48x64, 64x16, 64x64, 64x32, 128
    expected = {("llama", 2): 8256 + 2 * 18560, ("llama", 4): 4160 + 2 * 10368}.get((arch, tp))
    assert len(sizes) == 1 and (expected is None or sizes == {expected})
    for lines in outs[1:]:
        assert [x["version"] for x in _steps(lines)] == [1, 2, 3]
        assert all(x["differ"] == [] for x in _steps(lines))


def test_driven_through_vllms_trainer_factory():
    """WeightTransferTrainerFactory.trainer_init + send_weights, with an in-process `LLM` (its RL
    entry points, vLLM's own, over one worker: tests/vllm_hosts.py) as the client, adapted by
    the backend's LLMClient: vLLM's worker methods run in vLLM's order, three refits, each
    equal to vLLM's own load of that step. vLLM's HTTP and Ray clients: test_vllm_clients.py."""
    (lines,) = run_all(["driven", str(_port())])
    assert [(x["step"], x["differ"], x["moved_storage"], x["version"], x["weight_version"]) for x in _steps(lines)] \
        == [(1, [], [], 1, "1"), (2, [], [], 2, "2"), (3, [], [], 3, "3")]
    assert lines[-1]["adapted"] is True
    assert lines[-1]["calls"] == ["init_weight_transfer_engine"] + \
        ["start_weight_update", "update_weights", "finish_weight_update"] * 3


def test_a_whole_vllm_llm_is_the_trainer_factorys_client():
    """`vllm.LLM(..., weight_transfer_config={"backend": "layoutlang"})`: vLLM's worker builds
    the backend in its load_model; the trainer from WeightTransferTrainerFactory, given the LLM
    itself as its client, drives LLM.init_weight_transfer_engine / start_weight_update /
    update_weights / finish_weight_update(weight_version) around three refits, each equal to
    vLLM's own load of that step's checkpoint."""
    (llm,) = run_all(["llm", str(_port())])
    assert [x["version"] for x in _steps(llm)] == ["1", "2", "3"]
    assert all(x["differ"] == [] and x["replicas"] == ["vllm-0"] for x in _steps(llm))
    assert llm[-1]["engines"] == ["LayoutlangEngine"]


def test_refused_before_a_byte_moves():
    """Each refused case names the parameter and what differs; none reaches the store (the
    address is a port nobody listens on)."""
    (lines,) = run_all(["refused"])
    cases = {x["case"]: x["message"] for x in lines if "case" in x}
    assert "`model.layers.0.mlp.gate_up_proj.weight`: the layout says [192, 64] fp32, vLLM holds [256, 64] " \
           "float32" in cases["layout"]
    assert "`model.layers.1.self_attn.o_proj`: quantization method Fp8LinearMethod stores kernel-format" \
           in cases["quantized"]
    assert "live parameter `model.layers.0.mlp.extra` [3] is not in the layout" in cases["uncovered"]
    assert all("nothing was moved" in m for m in cases.values())


def test_eplb_replica_refits_every_physical_expert_and_follows_rebalances():
    """EPLB (Qwen3-MoE, 4 experts + 2 redundant, EP faked at 2; vLLM refuses EPLB off CUDA, so
    the program sets the layers' EplbState by hand, as vLLM's EplbState does): the backend
    reads vLLM's live physical -> logical map at each update and publishes it; the trainer
    re-plans for it. After each of three refits (the map rebalanced before the second), every
    physical slot on each rank holds its logical expert of that step's checkpoint (the slot rule
    written out in the program) and every other parameter equals vLLM's own load. A map that
    is no map is refused at the next update, before anything is entered or published."""
    port = _port()
    trainer, *ranks = run_all(["eplb_trainer", str(port)], *(["eplb_engine", str(port), str(r)] for r in range(2)))
    assert [x["replicas"] for x in _steps(trainer)] == [["vllm-0"]] * 3
    for rank, lines in enumerate(ranks):
        steps = _steps(lines)
        assert [x["version"] for x in steps] == [1, 2, 3]
        assert all(x["differ"] == [] and x["wrong"] == [] for x in steps), steps
        # rank r holds physical slots 3r..3r+2 (vLLM's linear map over 6 slots): experts, by hand
        slots = [x["slots"] for x in steps]
        by_hand = {0: [{"0": [0, 1, 2], "1": [3, 2, 1]}, {"0": [2, 0, 3], "1": [1, 1, 0]}],
                   1: [{"0": [3, 1, 2], "1": [0, 0, 3]}, {"0": [1, 3, 0], "1": [2, 3, 2]}]}[rank]
        assert slots == [by_hand[0], by_hand[1], by_hand[1]], slots
        assert steps[0]["layout"] != steps[1]["layout"] == steps[2]["layout"]  # republished once
        bad = next(x for x in lines if x.get("case") == "bad map")
        assert bad["message"] and "EngineRefused" in bad["message"] and "MoE layer 1" in bad["message"] \
            and "slot 1" in bad["message"], bad
        assert bad["entered"] is False and bad["layout"] == steps[2]["layout"], bad
        # live states that are no map of the table: 2 MoE layers, P = 4 + 2 slots (the program's model)
        refusals = next(x for x in lines if x.get("case") == "refusals")["messages"]
        assert refusals == {
            "layers": "EngineRefused: error: EPLB: the model has 2 MoE layers, the layout's EPLB table 3 rows",
            "out of range": "EngineRefused: error: EPLB: MoE layer 0's map puts logical expert 0 in physical slot 6, "
                            "which is out of range (6 slots)",
            "empty slot": "EngineRefused: error: EPLB: MoE layer 0's map leaves physical slot 5 without a logical expert",
            "no table": "EngineRefused: error: EPLB is on but the layout has no `EPLB` table (a model without routed "
                        "experts?)",
            "good": [[2, 0, 3, 1, 3, 0], [1, 1, 0, 2, 3, 2]]}, refusals  # step 3's map, read back


def test_vllms_uneven_and_round_robin_expert_maps_are_described():
    """EP faked at 2, on each rank (docs/language.md 14.8): 5 experts (vLLM's linear map gives
    rank 0 three, rank 1 two) and DeepSeek's round_robin (rank r holds experts r, r + 2). The
    backend reads the placement off vLLM's expert_map, the layout matches named_parameters, and
    after vLLM's own load_weights each local slot holds the expert the layout places there;
    the slots expected are written out here from vLLM's rule, not read from the layout."""
    (lines,) = run_all(["placement"])
    seen = {(x["case"], x["rank"]): x for x in lines if "case" in x}
    expected = {("uneven", 0): ("linear", [0, 1, 2]), ("uneven", 1): ("linear", [3, 4]),
                ("round_robin", 0): ("round_robin", [0, 2]), ("round_robin", 1): ("round_robin", [1, 3])}
    for case, (placement, experts) in expected.items():
        got = seen[case]
        assert got["placement"] == placement and got["problems"] == [] and got["wrong"] == [], got
        assert got["slots"] and all(slots == experts for slots in got["slots"].values()), got


def test_vllms_plugin_loader_registers_the_backend():
    (lines,) = run_all(["plugin"])
    assert lines[-1] == {"ok": True, "engine": True, "trainer": True}


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
