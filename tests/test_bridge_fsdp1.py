"""The FSDP1 bridge on real torch FSDP1 (issue 52): a tiny HF Llama, each decoder layer its own unit
inside the root unit, on gloo ranks 0-1 of a world of 4 (FSDP1's `process_group=` those two),
`use_orig_params` False and True, into vLLM's TP2 layout as `layoutc new vllm` writes it (q/k rows
as rotary halves, as the bridge writes them) collocated on ranks 0-1 and into one on ranks 2-3, back
from each, a training step, `checkpoint.save` from the shards and `checkpoint.load` into a fresh
FSDP1 model; and a one-unit model on ranks 2-3 (`at 2`) into a whole
copy on rank 0 and back. tests/fsdp1_refit_program.py asserts every element there against
`summon_full_params`, vLLM's rules and FSDP1's own bookkeeping; here, the figures written out by
hand from FSDP1's rule (docs/language.md 14.9): H = 18, so fp32 parameters of 666 or 18 elements
leave 2 elements of alignment padding before the next one with `use_orig_params=True`.
"""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("transformers")

from layoutlang.runtime.launch import launch  # noqa: E402

PROGRAM = Path(__file__).with_name("fsdp1_refit_program.py")
# q_proj and k_proj as HF stores their rows, each of the Q = KV = 2 heads' (head_dim D = 4) rotary halves
# `(2, (re: 4/2 | im: 4/2))`: the names `layoutc new vllm` gives them, so that a flat key pairs (it pairs strictly)
LAYER = ("[(2, (re: 4/2 | im: 4/2)), 18] as model.layers.0.self_attn.q_proj.weight | "
         "[(2, (re: 4/2 | im: 4/2)), 18] as model.layers.0.self_attn.k_proj.weight | "
         "[8, 18] as model.layers.0.self_attn.v_proj.weight | [18, 8] as model.layers.0.self_attn.o_proj.weight | "
         "[24, 18] as model.layers.0.mlp.gate_proj.weight | [24, 18] as model.layers.0.mlp.up_proj.weight | "
         "[18, 24] as model.layers.0.mlp.down_proj.weight | [18] as model.layers.0.input_layernorm.weight | "
         "[18] as model.layers.0.post_attention_layernorm.weight")
ROOT = "[37, 18] as model.embed_tokens.weight | [18] as model.norm.weight | [37, 18] as lm_head.weight"


def test_fsdp1_llama_refits_trains_saves_and_loads_from_its_flat_shards(tmp_path):
    results = launch({"dir": str(tmp_path)}, 4, timeout=240, program=str(PROGRAM))
    for r in results:
        assert r.ok, f"rank {r.rank}: {r.error}\n{(r.result or {}).get('trace', '')}{r.stderr[-3000:]}"
    rank0, rank1 = results[0].result, results[1].result
    root = "_fsdp_wrapped_module._flat_param"
    layer0 = "_fsdp_wrapped_module.model.layers.0._fsdp_wrapped_module._flat_param"
    for tag, align in (("flat", ""), ("orig", " align 4")):
        text = rank0[f"text_{tag}"]
        assert text == rank1[f"text_{tag}"]  # the same on every rank
        assert "mesh fsdp (dp=2)\n" in text
        # the root unit keeps what no layer holds, in registration order; a unit per decoder layer
        assert f"tensor {root} [flat({ROOT}){align} pad dp over dp] fp32\n" in text
        assert f"tensor {layer0} [flat({LAYER}){align} pad dp over dp] fp32\n" in text
        assert text.count("tensor ") == 3
        # every engine element on both ranks was compared with summon_full_params, collocated and on
        # ranks 2-3 (their tensors sent to rank 0)
        assert rank0[f"engine_checked_{tag}"] == rank1[f"engine_checked_{tag}"] > 0
        assert rank0[f"separate_ranks_{tag}"] == [2, 3]
        assert rank0[f"separate_checked_{tag}"] == 2 * rank0[f"engine_checked_{tag}"]
    # Root: 666 + 18 + 666 = 1350 -> 675 per rank; with alignment the norm starts at 668 and
    # lm_head at 688: 1354 -> 677. A layer: 7 x 144/432 + 18 + 18 = 1908 -> 954; aligned, the
    # second norm starts at 1892: 1910 -> 955.
    assert rank0["local_flat"] == {root: 675, layer0: 954, layer0.replace("layers.0", "layers.1"): 954}
    assert rank0["local_orig"] == {root: 677, layer0: 955, layer0.replace("layers.0", "layers.1"): 955}
    # alignment padding held: rank 0 [666, 668) of the root; rank 1 [686, 688) of the root and
    # [1890, 1892) of each layer; no tail padding (every total is even), none without alignment
    assert (rank0["padding_orig"], rank1["padding_orig"]) == (2, 6)
    assert (rank0["padding_flat"], rank1["padding_flat"]) == (0, 0)
    # a load leaves the padding as FSDP1 made it: its marker value between parameters (the tail
    # padding is 0: none here); the program checks it is untouched element by element
    from torch.distributed.fsdp._flat_param import _FLAT_PARAM_PADDING_VALUE
    # checkpoint.save from the shards: each file byte for byte the one save_pretrained wrote
    assert rank0["same_file_bytes_flat"] and rank0["same_file_bytes_orig"]
    assert rank1["load_padding_orig"] == [float(_FLAT_PARAM_PADDING_VALUE)]
    # the worked figures of docs/language.md 14.9, from the live bridge
    assert ("[flat([3, 5] as 0.weight | [3] as 0.bias | [7, 3] as 1.weight | [7] as 1.bias) align 4 pad dp over dp] "
            "fp32") in rank0["linears"]
    # bf16 forward dtype over fp32 storage: 16 bytes of bf16 are 8 elements; 0.bias at 16, 1.weight at
    # 24, 1.bias at 48, 55 elements padded to 56: 28 per rank
    assert ("[flat([3, 5] as 0.weight | [3] as 0.bias | [7, 3] as 1.weight | [7] as 1.bias) align 8 pad dp over dp] "
            "fp32") in rank0["bf16_forward"]
    assert rank0["bf16_forward_local"] == rank1["bf16_forward_local"] == 28
    # a tied lm_head is the embedding's one key; the checkpoint wrapper is not in the keys
    tied = rank0["tied"]
    assert (f"tensor {root} [flat([37, 18] as model.embed_tokens.weight | [18] as model.norm.weight) align 4 pad dp "
            "over dp] fp32\n") in tied
    assert f"tensor {layer0} [flat({LAYER}) align 4 pad dp over dp] fp32\n" in tied
    assert rank0["unsharded"] == ("error: unit `<root>`: its flat parameter holds 52 elements, not its shard of 26: "
                                  "it is unsharded now\nhelp: call the bridge outside forward/backward and outside "
                                  "summon_full_params")
    assert rank0["mixed"].startswith("error: parameter `1.weight` is torch.bfloat16 in a FlatParameter of "
                                     "torch.float32: a flat dim holds one dtype")
    # a unit on ranks 2-3: the mesh says where; all 15 + 3 + 21 + 7 elements reach rank 0
    ranks23 = results[2].result["offset_text"]
    assert ranks23 == results[3].result["offset_text"] == rank0["offset_text"]
    assert "mesh fsdp (dp=2) at 2\n" in ranks23
    assert ("tensor _fsdp_wrapped_module._flat_param [flat([3, 5] as 0.weight | [3] as 0.bias | [7, 3] as 1.weight | "
            "[7] as 1.bias) align 4 pad dp over dp] fp32\n") in ranks23
    assert rank0["offset_checked"] == 46
    assert rank0["no_shard"].startswith("error: unit `<root>` uses NO_SHARD: only FULL_SHARD and SHARD_GRAD_OP")


def _bookkeeping(numels, padding, sharded):
    """A FlatParameter's bookkeeping as torch records it (the fields `_check_offsets` reads)."""
    from types import SimpleNamespace

    import torch

    return SimpleNamespace(_numels_with_padding=tuple(numels), _is_padding_mask=list(padding),
                           _unpadded_unsharded_size=torch.Size([sum(numels)]), _sharded_size=torch.Size([sharded]))


def test_alignment_that_is_not_one_uniform_rule_is_refused():
    """FSDP1 pads before a parameter up to a multiple of `_aligned_numel` (torch 2.13,
    FlatParamHandle._init_flat_param_and_metadata); anything else has no `align A` to say it."""
    from layoutlang.bridges.families import BridgeError
    from layoutlang.bridges.fsdp1 import _check_offsets

    keys = (("0.weight", (3, 5)), ("0.bias", (3,)))
    # torch's own: 0.weight [0, 15), 1 element of padding, 0.bias [16, 19), 1 to the world size of 2
    _check_offsets("unit `<root>`", keys, _bookkeeping((15, 1, 3, 1), (False, True, False, True), 10), 4, 2)
    _check_offsets("unit `<root>`", keys, _bookkeeping((15, 3), (False, False), 9), 1, 2)  # no alignment
    with pytest.raises(BridgeError) as e:  # the bias 3 elements later than the rule
        _check_offsets("unit `<root>`", keys, _bookkeeping((15, 3, 3), (False, True, False), 11), 4, 2)
    assert str(e.value).startswith("error: parameter `0.bias` starts at flat element 18 of its unit's FlatParameter; "
                                   "the uniform rule `align 4` places it at 16\nhelp: FSDP1 padded this unit")
    with pytest.raises(BridgeError) as e:  # shards of 12 over 2 ranks for 19 elements: more than `pad dp`
        _check_offsets("unit `<root>`", keys, _bookkeeping((15, 1, 3), (False, True, False), 12), 4, 2)
    assert str(e.value) == ("error: unit `<root>`: its parameters end at flat element 19, and its 2 shards hold 24: "
                            "not `pad dp` (the next multiple of 2)")


def test_flat_keys_of_a_transformers_model_are_its_hf_keys_and_dims():
    """The rule both flat bridges write keys by (flat_layout.hf_flat_keys): a transformers Llama's q/k rows
    as HF's rotary halves (Q = KV = 2 heads of D = 4, by hand), every other key plain; FSDP1's units may
    hold some parameters only (`every=False`), ZeRO-3 must partition all of them; a plain module's keys
    are its parameter names with their shapes."""
    import torch
    from transformers import LlamaForCausalLM

    from fsdp1_refit_program import config
    from layoutlang.bridges.families import BridgeError
    from layoutlang.bridges.flat_layout import hf_flat_keys

    with torch.device("meta"):
        model = LlamaForCausalLM(config())
    shapes = {n: tuple(p.shape) for n, p in model.named_parameters() if n.startswith("model.layers.1.")}
    keys = hf_flat_keys(model, shapes, every=False)
    assert list(keys) == list(shapes)
    for part in ("q_proj", "k_proj"):
        name = f"model.layers.1.self_attn.{part}.weight"
        assert keys[name] == [(["(2, (re: 4/2 | im: 4/2))", "18"], name)]
    assert keys["model.layers.1.mlp.down_proj.weight"] == [(["18", "24"], "model.layers.1.mlp.down_proj.weight")]
    with pytest.raises(BridgeError) as e:
        hf_flat_keys(model, shapes)
    assert str(e.value).startswith("error: the layout describes `model.embed_tokens.weight` but LlamaForCausalLM "
                                   "has no such parameter")
    with pytest.raises(BridgeError) as e:
        hf_flat_keys(model, {**shapes, "model.layers.1.mlp.up_proj.weight": (24, 17)}, every=False)
    assert str(e.value).startswith("error: LlamaForCausalLM stores `model.layers.1.mlp.up_proj.weight` with shape "
                                   "[24, 17], the layout says [24, 18]")
    linear = torch.nn.Linear(5, 3)
    assert hf_flat_keys(linear, {"weight": (3, 5), "bias": (3,)}) == {"weight": [(["3", "5"], "weight")],
                                                                       "bias": [(["3"], "bias")]}
