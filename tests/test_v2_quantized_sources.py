"""Refits FROM quantized v2 stored tensors: vLLM's MXFP8 engine back to HF and Megatron.

Why: the usual refit goes trainer (bf16) -> engine (MXFP8); the reverse (an
engine's weights back into a checkpoint or a trainer: vLLM fused q|k|v and
gate|up with part keys, FusedMoE stacked w13/w2 over ep) has a quantized
SOURCE whose keys lie inside stored tensors (LANGUAGE.md 8.1, 8.2). The
destination must then hold what each source shard holds after its own
quantization, dequantized (LANGUAGE.md 4): `layoutlang.runtime.fill` computes
that from the source layout and each worker checks every element with it.

Here, first, that expectation is cross-checked against tests/reference_quant.py
(never the runtime's quantizer) from a rule written out by hand: every MXFP8
weight of these engines stores whole key rows along its last (H or I) dim,
local offsets multiples of 32, so each key row is quantized in blocks of 32 of
the key's own row; non-quantized weights arrive exact. Then each pair refits on
local gloo workers with `verify` (checksums of every transfer), on disjoint or
shared ranks as the examples' args allow (the HF layout and vLLM take `AT`;
Megatron's expert mesh sits at 0, so vLLM either shares its first ranks or
moves past them), and every destination element of every rank is checked.
"""

from pathlib import Path

import pytest
import torch

import reference_quant as ref
from layoutlang.compiler import compile_plan
from layoutlang.runtime.fill import expected_destination, values
from layoutlang.runtime.launch import launch

SMALL_V2 = Path(__file__).parent.parent / "examples" / "small" / "v2"


# (id, source, destination, source args, destination args, processes, ranks shared)
PAIRS = [
    ("llama-vllm-mxfp8-to-hf-disjoint", "llama_vllm", "llama_hf", {"AT": 0}, {"AT": 4}, 5, False),
    ("llama-vllm-mxfp8-to-hf-collocated", "llama_vllm", "llama_hf", {"AT": 0}, {"AT": 1}, 4, True),
    ("moe-fusedmoe-stacked-to-hf-disjoint", "moe_vllm", "moe_hf", {"AT": 0}, {"AT": 4}, 5, False),
    ("moe-fusedmoe-stacked-to-hf-collocated", "moe_vllm", "moe_hf", {"AT": 0}, {"AT": 2}, 4, True),
    ("moe-fusedmoe-stacked-to-megatron-collocated", "moe_vllm", "moe_megatron", {"AT": 0}, {}, 8, True),
    ("moe-fusedmoe-ep2-to-megatron-etp1-disjoint", "moe_vllm", "moe_megatron", {"AT": 4, "EP": 2}, {"ETP": 1}, 6,
     False),
]
CASES = [pytest.param(*p[1:7], id=p[0], marks=p[7:]) for p in PAIRS]


def _path(name: str) -> str:
    return str(SMALL_V2 / f"{name}.layout")


def _plan(src: str, dst: str, src_args: dict, dst_args: dict):
    return compile_plan(_path(src), _path(dst), src_args=src_args, dst_args=dst_args)


HEAD_DIM = 8  # D of examples/small/v2/llama_hf.layout


def _logical_row(key: str, row: int, n: int) -> int:
    """The logical row of stored row `row` of an HF key. q_proj / k_proj rows are declared
    `(NH, (re: D/2 | im: D/2))` (rotary halves), and LANGUAGE.md 3 hoists a concatenation
    out of its product: logically every head's re half comes first, then every im half."""
    if not key.endswith(("q_proj.weight", "k_proj.weight")) or "experts" in key:
        return row
    half = HEAD_DIM // 2
    head, part, j = row // HEAD_DIM, row % HEAD_DIM // half, row % half
    return part * (n // 2) + head * half + j


def _reference_rows(key: str, shape: tuple[int, int], rows: list[int], quantized: bool) -> torch.Tensor:
    """Stored rows of key `key` as the destination must hold them: the fill (values of the
    logical index), MXFP8-quantized by the reference in 32-blocks of each row when the source is."""
    flat = torch.tensor([_logical_row(key, r, shape[0]) * shape[1] + c for r in rows for c in range(shape[1])])
    grid = values(key, flat).reshape(len(rows), shape[1])
    if not quantized:
        return grid
    return torch.tensor(ref.quantize_mxfp8(grid.tolist()).values)


@pytest.mark.parametrize("model,src_args", [("llama", {"AT": 0}), ("moe", {"AT": 0}), ("moe", {"AT": 0, "EP": 2})],
                         ids=["llama", "moe-ep4", "moe-ep2"])
def test_expected_hf_values_equal_the_reference_quantization(model, src_args):
    """Every key of the HF checkpoint, refitted from vLLM: rows at both ends and around the
    middle (a TP or EP boundary) equal the reference's quantization of the key's own rows."""
    plan = _plan(f"{model}_vllm", f"{model}_hf", src_args, {"AT": 4})
    quantized = {key for key, holders in plan.src.key_index.items() if holders[0][0].dtype == "mxfp8"}
    assert len(quantized) == {"llama": 14, "moe": 48}[model]  # q k v o gate up down x 2; 8 experts x 3 x 2
    checked = set()
    for t in plan.dst.tensors:
        exp = expected_destination(t, 4, plan)
        assert exp.choices == () and bool(exp.data.all()), t.name
        if t.key not in quantized:  # embeddings, norms, the router: exact
            grid = values(t.key, torch.arange(exp.values.numel()))
            assert torch.equal(exp.values.to(torch.float32).reshape(-1), grid), t.key
            continue
        n = t.logical_shape[0]
        rows = sorted({0, n // 2 - 1, n // 2, n - 1})
        want = _reference_rows(t.key, t.logical_shape, rows, quantized=True)
        assert torch.equal(exp.values[rows].to(torch.float32), want), t.key
        assert not torch.equal(want, _reference_rows(t.key, t.logical_shape, rows, quantized=False))
        checked.add(t.key)
    assert checked == quantized


@pytest.mark.timeout(240)
@pytest.mark.parametrize("src,dst,src_args,dst_args,nproc,shared", CASES)
def test_quantized_v2_source_refits_and_checks_every_element(src, dst, src_args, dst_args, nproc, shared):
    plan = _plan(src, dst, src_args, dst_args)
    assert plan.world == nproc
    assert all(t.dtype == "mxfp8" for t in plan.src.tensors if t.regions is not None)  # the keyed sources
    ranks = [{r for t in side.tensors for r in t.ranks()} for side in (plan.src, plan.dst)]
    assert bool(ranks[0] & ranks[1]) == shared
    results = launch({"src": _path(src), "dst": _path(dst), "src_args": src_args, "dst_args": dst_args,
                      "verify": True}, nproc, timeout=180)
    for r in results:
        assert r.ok, f"rank {r.rank}: {r.error} {r.result and r.result.get('check_errors')}"
    for r in results:  # every destination tensor of the rank was checked, element by element
        held = sum(1 for t in plan.dst.tensors if r.rank < plan.dst.ranks and t.holds(r.rank))
        assert r.result["checked_tensors"] == held
    assert sum(r.result["checked_tensors"] for r in results) == sum(len(list(t.ranks())) for t in plan.dst.tensors)
    received = sum(r.result["received_bytes"] for r in results)
    local = sum(r.result["local_bytes"] for r in results)
    assert received + local == plan.stats["bytes"]
    assert sum(r.result["sent_bytes"] for r in results) == received == plan.stats["network_bytes"]
    assert (plan.stats["local_bytes"] > 0) == shared
