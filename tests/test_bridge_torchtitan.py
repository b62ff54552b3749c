"""The torchtitan bridge on real torchtitan 0.3.0 (issue 29): Llama3 (GQA), Qwen3-MoE and
DeepSeek-V3 at tiny size, sharded by torchtitan's own FSDP2 on 2 gloo ranks, and Llama3 by
its own TP plan at TP2.

One launch of tests/torchtitan_program.py serves every assertion below. Expectations
come from torchtitan and transformers, never from the code under test: the refit into
the HF layout equals torchtitan's `StateDictAdapter.to_hf` element by element, HF's
`from_pretrained` of those tensors gives torchtitan's logits, and the reverse refit
equals `from_hf` (read back through torch's own gather). Single-process tests check the
convention and the diagnostics.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

pytest.importorskip("torchtitan")
pytest.importorskip("transformers")

from layoutlang import loads  # noqa: E402
from layoutlang.bridges.families import BridgeError, model_from_config, render  # noqa: E402
from layoutlang.runtime.launch import launch  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))  # tests/torchtitan_program.py, for single-process tests

PROGRAM = Path(__file__).with_name("torchtitan_program.py")
MODELS = ("llama3", "qwen3_moe", "deepseek_v3")


@pytest.fixture(scope="module")
def launched():
    results = launch({"models": list(MODELS), "tp": ["llama3"]}, 2, timeout=200, program=str(PROGRAM),
                     env={"PYTHONPATH": os.pathsep.join([str(PROGRAM.parent), os.environ.get("PYTHONPATH", "")])})
    reports = []
    for r in results:
        assert r.result is not None, f"a rank left no report (exit {r.returncode}):\n{r.stderr[-3000:]}"
        assert r.result.get("ok"), f"{r.result.get('error')}\n{r.result.get('trace', '')[-3000:]}"
        reports.append(r.result)
    return reports


@pytest.mark.timeout(240)
@pytest.mark.parametrize("name", MODELS)
def test_refit_into_hf_equals_to_hf_and_gives_torchtitans_logits(launched, name):
    got = launched[1][name]
    assert got["checked"] > 0 and got["ops"] > 0
    assert got["logit_diff"] < 1e-5, got["logit_diff"]


@pytest.mark.timeout(240)
@pytest.mark.parametrize("name", MODELS)
def test_reverse_refit_equals_from_hf_on_every_rank(launched, name):
    for report in launched:
        assert report[name]["reverse_checked"] > 0


@pytest.mark.timeout(240)
def test_the_description_is_the_same_on_both_ranks_and_names_the_real_storage(launched):
    for name in MODELS:
        assert launched[0][name]["text"] == launched[1][name]["text"]
    llama = launched[0]["llama3"]["text"]
    assert "layers.0.attention.qkv_linear.wqkv.weight" in llama and "(re: 1 | im: 1)" in llama
    assert "chunk fsdp ragged" in llama  # FSDP2's Shard(0) of a fused dim cuts the stored rows
    moe = launched[0]["qwen3_moe"]["text"]
    assert "inner_experts.w1_EFD" in moe and "expert_bias_E" not in moe
    assert "(re: 1 | im: 1)" not in moe and "(re: " in moe  # Qwen3: HF's halves, not Meta's pairs
    dsv3 = launched[0]["deepseek_v3"]["text"]
    assert "layers.1.moe.expert_bias_E as model.layers.1.mlp.gate.e_score_correction_bias" in dsv3


@pytest.mark.timeout(240)
def test_tensor_parallel_llama3_refits_into_hf_equal_to_to_hf(launched):
    got = launched[1]["llama3_tp2"]
    assert got["checked"] > 0
    text = launched[0]["llama3_tp2"]["text"]
    assert text == launched[1]["llama3_tp2"]["text"]
    assert "chunk world ragged" in text and "[64, 64 over world ragged]" in text  # colwise wqkv, rowwise wo


LLAMA = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
         "num_attention_heads": 8, "num_key_value_heads": 2, "vocab_size": 256}


def test_the_convention_pairs_with_hf_without_edits():
    """The hf convention writes the rotary halves (issue 29): the Meta-order Llama3 pairs with it
    both ways, and `with_rotary_halves` (kept for its callers) leaves its Document as it is.
    tests/test_rotary_pairing.py checks the rows element by element."""
    from layoutlang.bridges.families import document, render_document
    from layoutlang.bridges.torchtitan_layout import with_rotary_halves
    from layoutlang.compiler import compile_plan

    model = model_from_config(LLAMA)
    titan = loads(render(model, "torchtitan", {"DP": 2}), "titan")
    hf = loads(render(model, "hf"), "hf")
    assert compile_plan(titan, hf).stats["ops"] > 0 and compile_plan(hf, titan).stats["ops"] > 0
    assert render_document(with_rotary_halves(document(model, "hf")))[0] == render(model, "hf")


def test_a_family_torchtitan_lacks_is_a_config_error():
    from layoutlang.bridges.families import ConfigError

    with pytest.raises(ConfigError, match="no model of family `mistral`"):
        render(model_from_config({**LLAMA, "model_type": "mistral"}), "torchtitan")


def test_a_module_that_is_not_torchtitans_is_refused_by_name():
    import torch

    from layoutlang.bridges import torchtitan

    with pytest.raises(BridgeError, match="`Linear` is not a torchtitan model"):
        torchtitan.describe(torch.nn.Linear(2, 2))


def test_a_whole_model_is_described_on_one_rank_with_every_parameter():
    import torchtitan_program as program

    from layoutlang.bridges import torchtitan

    model, *_ = program.build("deepseek_v3", seed=0)
    layout = loads(torchtitan.describe(model, at=3), "whole")
    stored = {n: tuple(p.shape) for n, p in model.named_parameters()}
    stored["layers.1.moe.expert_bias_E"] = (4,)  # the buffer HF calls a weight
    assert {t.name: t.local_shape for t in layout.tensors} == stored
    assert all(list(t.ranks()) == [3] for t in layout.tensors)


def test_a_non_fused_qkv_is_refused_naming_the_parameter():
    import torchtitan_program as program

    from layoutlang.bridges import torchtitan

    cfg, *_ = program.MODELS["llama3"]()
    for layer in cfg.layers:  # torchtitan's own non-fused projections (QKVLinear: wq, wk, wv)
        from torchtitan.models.common.attention import QKVLinear
        from torchtitan.models.common.linear import Linear

        a = layer.attention
        a.qkv_linear = QKVLinear.Config(head_dim=8, wq=Linear.Config(in_features=64, out_features=64),
                                        wkv=Linear.Config(in_features=64, out_features=16))
    with pytest.raises(BridgeError, match=r"stores `layers\.0\.attention\.qkv_linear\.wq\.weight` \[64, 64\]") as e:
        torchtitan.describe(cfg.build())
    assert "non-fused QKV" in e.value.help
