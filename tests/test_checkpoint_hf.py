"""Any HF checkpoint converts (issue 49 item 3): `save_pretrained` directories WITH their config.json.

Tiny Llama, Qwen3-MoE and DeepSeek-V3 models are built by transformers from a config (no
download), in bf16, and saved by `save_pretrained`. References, independent of the code
under test: the tensors as save_pretrained wrote them (read back by `safe_open`; for the
Llama also its `state_dict()`), cast by torch (fp32 is exact from bf16), mxfp8 by
tests/reference_quant.py (exact rationals, OCP MX rules). HF cache snapshots: a directory
of symbolic links into `blobs/`, built here by hand.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import torch
import transformers
from safetensors import safe_open

from layoutlang import loads
from layoutlang.checkpoint import CheckpointError, describe, save
from layoutlang.cli import main
from reference_quant import quantize_mxfp8

CONFIGS = {
    "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM,
              dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                   num_key_value_heads=1, head_dim=16, vocab_size=64)),
    "qwen3_moe": (transformers.Qwen3MoeConfig, transformers.Qwen3MoeForCausalLM,
                  dict(hidden_size=32, intermediate_size=64, moe_intermediate_size=32, num_hidden_layers=1,
                       num_attention_heads=2, num_key_value_heads=1, head_dim=16, vocab_size=64, num_experts=2,
                       num_experts_per_tok=1)),
    "deepseek_v3": (transformers.DeepseekV3Config, transformers.DeepseekV3ForCausalLM,
                    dict(hidden_size=32, intermediate_size=64, moe_intermediate_size=32, num_hidden_layers=2,
                         first_k_dense_replace=1, n_routed_experts=2, num_experts_per_tok=1, n_shared_experts=1,
                         n_group=1, topk_group=1, num_attention_heads=2, num_key_value_heads=2, q_lora_rank=32,
                         kv_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16,
                         vocab_size=64)),
}


def _read(folder) -> dict:
    out = {}
    for path in sorted(Path(folder).glob("*.safetensors")):
        with safe_open(str(path), "pt") as f:
            out.update({k: f.get_tensor(k) for k in f.keys()})
    return out


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """{family: (its save_pretrained directory, the tensors save_pretrained wrote)}; the Llama is cut
    into several files with an index."""
    out = {}
    for family, (config_cls, model_cls, kw) in CONFIGS.items():
        torch.manual_seed(0)
        model = model_cls(config_cls(**kw)).to(torch.bfloat16)
        folder = tmp_path_factory.mktemp(family)
        model.save_pretrained(folder, max_shard_size="8KB" if family == "llama" else "5GB")
        assert (folder / "config.json").is_file()
        tensors = _read(folder)
        if family == "llama":
            assert (folder / "model.safetensors.index.json").is_file()
            state = model.state_dict()
            assert set(state) == set(tensors) and all(torch.equal(state[k], tensors[k]) for k in state)
        out[family] = (folder, tensors)
    return out


def _convert(capsys, *argv) -> None:
    code = main(["convert", *argv])
    got = capsys.readouterr()
    assert code == 0, got.err


@pytest.mark.parametrize("family", list(CONFIGS))
def test_convert_with_config_json_to_fp32_bf16_and_mxfp8(saved, family, tmp_path, capsys):
    folder, want = saved[family]
    for dtype in ("fp32", "bf16", "mxfp8"):
        out = tmp_path / dtype
        _convert(capsys, str(folder), "-o", str(out), "--dtype", dtype)
        got = _read(out)
        if dtype != "mxfp8":
            assert set(got) == set(want)
            for key, t in want.items():
                assert got[key].dtype == {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype], key
                assert torch.equal(got[key], t.to(got[key].dtype)), key
            continue
        # a key whose last dim is not a multiple of 32 (Qwen3's [16] q/k norms, DeepSeek-V3's [2] expert
        # bias) cannot be mxfp8 (LANGUAGE.md 4): it keeps the checkpoint's bf16, as quantized checkpoints
        # keep their norms
        plain = {k for k, t in want.items() if t.shape[-1] % 32}
        assert plain == {"qwen3_moe": {f"model.layers.0.self_attn.{p}_norm.weight" for p in "qk"},
                         "deepseek_v3": {"model.layers.1.mlp.gate.e_score_correction_bias"},
                         "llama": set()}[family]
        assert set(got) == set(want) | {f"{k}_scale" for k in want if k not in plain}
        for key in plain:
            assert got[key].dtype == want[key].dtype and torch.equal(got[key], want[key]), key
        for key, t in want.items():
            if key in plain:
                continue
            rows = t.float().reshape(-1, t.shape[-1])  # blocks of 32 along the last dim
            ref = quantize_mxfp8(rows.tolist())
            assert got[key].view(torch.uint8).reshape(rows.shape).tolist() == ref.codes, key
            assert got[f"{key}_scale"].reshape(rows.shape[0], -1).tolist() == ref.scales, key


@pytest.mark.timeout(240)
@pytest.mark.parametrize("family", list(CONFIGS))
def test_convert_to_a_vllm_tp2_layout_on_two_processes(saved, family, tmp_path, capsys):
    """`layoutc new vllm --set TP=2` of the checkpoint's own config.json; OUT holds no config."""
    folder, want = saved[family]
    layout = tmp_path / "vllm_tp2.layout"
    assert main(["new", "vllm", "--config", str(folder / "config.json"), "--set", "TP=2", "-o", str(layout)]) == 0
    capsys.readouterr()
    _convert(capsys, str(folder), "-o", str(tmp_path / "out"), "--to", str(layout), "--nproc", "2")
    got = _read(tmp_path / "out")
    assert set(got) == set(want)
    for key, t in want.items():
        assert torch.equal(got[key], t.to(got[key].dtype)), key


def test_a_failed_save_leaves_no_directory(tmp_path):
    layout = loads("mesh m (one=1)\ntensor a [4, 4]\n", "<one>")
    misshapen = {"a": torch.zeros(5, 4, dtype=torch.bfloat16)}
    target = tmp_path / "new"
    with pytest.raises(Exception, match="a"):
        save(target, layout, misshapen)
    assert not target.exists()
    existing = tmp_path / "there"
    existing.mkdir()
    with pytest.raises(Exception, match="a"):
        save(existing, layout, misshapen)
    assert existing.is_dir() and list(existing.iterdir()) == []  # it was there before: kept, empty


def _snapshot(tmp_path: Path, folder: Path) -> Path:
    """An HF cache snapshot: every file a relative symbolic link into ../../blobs/."""
    blobs, snap = tmp_path / "blobs", tmp_path / "snapshots" / "abc"
    blobs.mkdir()
    snap.mkdir(parents=True)
    for i, f in enumerate(sorted(folder.iterdir())):
        shutil.copy(f, blobs / f"blob{i}")
        os.symlink(f"../../blobs/blob{i}", snap / f.name)
    return snap


def test_an_hf_cache_snapshot_of_symbolic_links_converts(saved, tmp_path, capsys):
    folder, want = saved["llama"]
    snap = _snapshot(tmp_path, folder)
    _convert(capsys, str(snap), "-o", str(tmp_path / "out"), "--dtype", "fp32")
    got = _read(tmp_path / "out")
    assert set(got) == set(want) and all(torch.equal(got[k], want[k].float()) for k in want)


@pytest.mark.parametrize("indexed", [True, False])
def test_a_dangling_or_looping_shard_link_is_an_error_naming_it(saved, tmp_path, indexed):
    folder, _ = saved["llama"]
    snap = _snapshot(tmp_path, folder)
    if not indexed:
        (snap / "model.safetensors.index.json").unlink()
        for f in sorted(snap.glob("*.safetensors"))[1:]:
            f.unlink()
    shard = sorted(snap.glob("*.safetensors"))[0]
    shard.unlink()
    os.symlink("../../blobs/gone", shard)
    with pytest.raises(CheckpointError) as e:
        describe(snap)
    assert e.value.message == f"{shard.name}: is a symbolic link to ../../blobs/gone, which does not exist"
    shard.unlink()
    os.symlink(shard.name, shard)
    with pytest.raises(CheckpointError) as e:
        describe(snap)
    assert e.value.message == f"{shard.name}: is a symbolic link that loops ({shard.name} -> {shard.name})"
