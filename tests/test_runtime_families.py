"""Every shipped model family refits for real: multi-process gloo runs of examples/small/.

examples/small/ holds miniatures of the shipped examples (same statements,
meshes and placement clauses, toy sizes): Llama-3-8B trainer -> vLLM TP2
(collocated) and TP4 > KV heads (non-collocated), uneven PP with `{l.local}`
-> an engine without PP, DeepSeek-V3-style dense + expert meshes -> a
different EP, and the Nemotron-H Mamba hybrid with packed, GTP-padded
in_proj; and, in examples/small/v2/, one Llama in three decompositions
(Megatron grouped QKV, vLLM fused q|k|v and gate|up in MXFP8, the unfused HF
checkpoint on one rank). Every one of them is keyed by HF checkpoint names
(LANGUAGE.md 8: fused tensors carry part keys), so a trainer of examples/small/
refits into a v2 layout of the same model as shipped (llama-train-to-v2-hf). Each test launches
local gloo workers that fill the source from logical coordinates (by key and
index in the key), refit with `verify` (checksums of every transfer) and
check every destination element (padding zero, MXFP8 quantized in place).
The bytes the workers receive plus copy locally must equal the plan's bytes.

Start-up costs about 1.3 s per process, so worlds stay at 8-12 ranks, and the
cases of one world size share one launch (tests/shared_launch.py: the same
workers run each case's job in turn, exactly as a launch of it alone would; a
case the shared launch does not reach, after another case failed, runs alone).
"""

from pathlib import Path

import pytest

from layoutlang.compiler import compile_plan
from layoutlang.compiler.graph import buckets
from layoutlang.runtime.launch import launch
from shared_launch import SharedLaunches, selected_params

SMALL = Path(__file__).parent.parent / "examples" / "small"

# (id, source, destination, args, processes)
FAMILIES = [
    ("llama-tp2-collocated", "llama_train", "llama_infer", {}, 8),
    ("llama-tp4-gt-kv-at8", "llama_train", "llama_infer_tp4", {}, 12),
    ("pp-uneven-to-no-pp", "pp_train", "pp_infer", {}, 8),
    ("moe-ep2-etp2-to-ep4", "moe_train", "moe_infer", {}, 8),
    ("mamba-gtp-padded-to-tp4", "mamba_train", "mamba_infer", {}, 8),
    # the HF-key convention across folders: the v1 miniature trainer into the HF checkpoint layout
    ("llama-train-to-v2-hf-checkpoint-at8", "llama_train", "v2/llama_hf", {"AT": 8}, 9),
    # version 2, HF-key convention: part keys inside fused tensors (LANGUAGE.md 8.1)
    ("v2-megatron-part-keys-to-vllm-fused-mxfp8", "v2/llama_megatron", "v2/llama_vllm", {}, 8),
    ("v2-hf-split-to-vllm-fused-at4", "v2/llama_hf", "v2/llama_vllm", {"AT": 4}, 8),
    ("v2-megatron-to-hf-checkpoint-at7", "v2/llama_megatron", "v2/llama_hf", {"AT": 7}, 8),
    # stacked experts (LANGUAGE.md 8.2): per-expert Megatron -> vLLM FusedMoE w13/w2, MXFP8
    ("v2-moe-per-expert-to-fusedmoe-stacked-at4", "v2/moe_megatron", "v2/moe_vllm", {"AT": 4}, 8),
    # transposed storage (LANGUAGE.md 8.3): GPT-2's HF Conv1D [in, out] -> a TP engine's [out, in]
    ("v2-gpt2-conv1d-transposed-to-tp2-at1", "v2/gpt2_hf", "v2/gpt2_tp", {"AT": 1}, 3),
]


def _paths(src: str, dst: str) -> tuple[str, str]:
    return str(SMALL / f"{src}.layout"), str(SMALL / f"{dst}.layout")


def _job(src: str, dst: str, args: dict, budget: int | None = None) -> dict:
    src, dst = _paths(src, dst)
    return {"src": src, "dst": dst, "args": args, "verify": True, "budget": budget}


BUCKETS = ("llama-train-to-llama-infer-at8-budget-16k", _job("llama_train", "llama_infer", {"AT": 8}, 16 * 1024), 12)
CASES = [(f[0], _job(*f[1:4]), f[4]) for f in FAMILIES] + [BUCKETS]


@pytest.fixture(scope="module")
def launches(request) -> SharedLaunches:
    """One launch per world size for the cases this session selected."""
    selected = selected_params(request, "test_family_refits_and_checks_every_element") | {BUCKETS[0]}
    batches: dict[str, tuple[int, list]] = {}
    for name, job, nproc in CASES:
        batches.setdefault(str(nproc), (nproc, []))[1].append((name, job))
    return SharedLaunches(batches, selected, timeout_per_case=60, alone_timeout=150)


def _refit(launches: SharedLaunches, name: str, src: str, dst: str, args: dict, budget: int | None = None):
    plan = compile_plan(src, dst, args=args)
    return plan, _checked(plan, launches.results_for(name), launches.where[name])


def refit_alone(src: str, dst: str, args: dict, nproc: int):
    """One refit in a launch of its own (other test files' pairs), checked as `_refit` checks."""
    plan = compile_plan(src, dst, args=args)
    results = launch({"src": src, "dst": dst, "args": args, "verify": True}, nproc, timeout=150)
    return plan, _checked(plan, results, f"a launch of its own ({nproc} ranks)")


def _checked(plan, results, where: str):
    """Every rank ok, the bytes the plan says, every destination tensor of every rank checked."""
    assert plan.world <= len(results)
    for r in results:
        assert r.ok, f"rank {r.rank} ({where}): {r.error} {r.result and r.result.get('check_errors')}"
    received = sum(r.result["received_bytes"] for r in results)
    local = sum(r.result["local_bytes"] for r in results)
    sent = sum(r.result["sent_bytes"] for r in results)
    assert received + local == plan.stats["bytes"]
    assert sent == received == plan.stats["network_bytes"]
    for r in results:  # every destination tensor of the rank was checked
        held = sum(1 for t in plan.dst.tensors if r.rank < plan.dst.ranks and t.holds(r.rank))
        assert r.result["checked_tensors"] == held
    return results


def _assert_disjoint(plan, results):
    """Non-collocated: every byte crosses the network, trainers only send, engines only receive."""
    assert plan.stats["local_bytes"] == 0
    assert all(r.result["received_bytes"] == 0 for r in results if r.rank < plan.src.ranks)
    assert all(r.result["sent_bytes"] == 0 for r in results if r.rank >= plan.src.ranks)


@pytest.mark.timeout(600)  # the first case of a world size waits for its whole shared launch
@pytest.mark.parametrize("name,src,dst,args", [f[:4] for f in FAMILIES], ids=[f[0] for f in FAMILIES])
def test_family_refits_and_checks_every_element(launches, name, src, dst, args):
    plan, results = _refit(launches, name, *_paths(src, dst), args)
    if dst == "llama_infer_tp4":  # on ranks 8-11, apart from the trainer
        _assert_disjoint(plan, results)


@pytest.mark.timeout(600)
def test_family_refits_non_collocated_in_several_buckets(launches):
    """The collocated Llama engine moved to ranks 8-11 (`AT=8`), staged under a 16 KiB budget.

    One run covers both variants: each costs a full process start-up.
    """
    src, dst = _paths("llama_train", "llama_infer")
    budget = 16 * 1024
    assert len(buckets(compile_plan(src, dst, args={"AT": 8}), budget)) > 1
    assert BUCKETS[1]["budget"] == budget
    plan, results = _refit(launches, BUCKETS[0], src, dst, {"AT": 8}, budget=budget)
    _assert_disjoint(plan, results)
    for r in results:  # staging stays under the budget plus the largest tensor
        assert r.result["staging_peak"] <= budget + r.result["largest_tensor_bytes"]
