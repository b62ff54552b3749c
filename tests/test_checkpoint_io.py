"""Checkpoint load and save end to end (issue 28: layoutlang.checkpoint.load / save).

Every expected value comes from outside layoutlang:
- the HF tensors, as `save_pretrained` wrote them and `safe_open` reads them;
- each format's rule written by hand (tests/checkpoint_program.py: vLLM packs
  q | k | v and gate | up per TP rank and pads the vocabulary to 64, k/v heads
  replicated when TP exceeds their count; Megatron's grouped qkv per query group,
  vocabulary padded to 128 * TP; the HF layout whole on every rank);
- `save_pretrained` of a reference model holding the same weights (keys, dtypes,
  shapes and bytes of every tensor, the index), `from_pretrained` and its logits,
  and the trainers' own forward passes (FSDP2, Megatron-Core);
- tests/reference_quant.py (exact, torch-free quantizers) for mxfp8 / fp8_b128,
  and dequantization written out here (fp8 code x its block's fp32 scale).

The multi-process cases share ONE launch of 2 gloo processes (tests/checkpoint_program.py,
`layoutlang.runtime.launch.launch`, killed at its timeout); the rest run in this process,
one `load(..., rank=r)` per rank.
"""

from __future__ import annotations

import json
import math
import os
import shutil
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("megatron.core")

from safetensors import safe_open  # noqa: E402
from safetensors.torch import save_file  # noqa: E402

from checkpoint_program import (  # noqa: E402 - tests/: the rules by hand, shared with the workers
    TORCH_DTYPE, _tokens, check_all, garbage, mx_values, plain_values, read_checkpoint, vllm_expected)
from layoutlang import load as load_layout  # noqa: E402
from layoutlang import loads  # noqa: E402
from layoutlang.checkpoint import CheckpointError, load, save  # noqa: E402
from layoutlang.cli import main as layoutc  # noqa: E402
from layoutlang.compiler.match import PlanError  # noqa: E402
from layoutlang.diagnostics import UsageError  # noqa: E402
from layoutlang.runtime.errors import RefitError  # noqa: E402
from layoutlang.runtime.launch import launch  # noqa: E402
from reference_quant import quantize_fp8_b128, quantize_mxfp8  # noqa: E402

PROGRAM = Path(__file__).with_name("checkpoint_program.py")
INDEX = "model.safetensors.index.json"
# the Llama every load reads: GQA (4 heads, 2 kv heads), vocabulary 100 (padded: 128 for vLLM, 256 Megatron)
LLAMA = {"H": 32, "L": 2, "Q": 4, "KV": 2, "D": 8, "F": 48, "V": 100}


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    """A bf16 HF Llama saved in several files with an index, and `layoutc new` layouts of its config."""
    c = LLAMA
    config = transformers.LlamaConfig(hidden_size=c["H"], num_hidden_layers=c["L"], num_attention_heads=c["Q"],
                                      num_key_value_heads=c["KV"], head_dim=c["D"], intermediate_size=c["F"],
                                      vocab_size=c["V"], tie_word_embeddings=False)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).to(torch.bfloat16)
    folder = tmp_path_factory.mktemp("llama")
    model.save_pretrained(folder, max_shard_size="10KB")
    assert (folder / INDEX).is_file() and len(list(folder.glob("*.safetensors"))) >= 3
    layouts = {}
    for name, argv in {"vllm": ["vllm", "--set", "TP=2"], "vllm4": ["vllm", "--set", "TP=4"],
                       "megatron": ["megatron", "--set", "TP=2"], "hf": ["hf", "--set", "DP=2"]}.items():
        layouts[name] = str(folder.parent / f"{folder.name}-{name}.layout")
        assert layoutc(["new", *argv, "--config", str(folder / "config.json"), "-o", layouts[name]]) == 0
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return folder, layouts, state


@pytest.fixture(scope="module")
def launched(llama, tmp_path_factory):
    """The one 2-process run of tests/checkpoint_program.py: (per-rank results, the job)."""
    folder, layouts, _ = llama
    out = tmp_path_factory.mktemp("saves")
    job = {"pg_timeout": 30, "llama_dir": str(folder), "llama": LLAMA, "layouts": layouts,
           "fsdp2": {"fp32": str(out / "fsdp2"), "fp32_ref": str(out / "fsdp2-ref"),
                     "bf16": str(out / "fsdp2-bf16"), "bf16_ref": str(out / "fsdp2-bf16-ref"),
                     "logits": str(out / "fsdp2-logits.safetensors")},
           "megatron": {"dir": str(out / "megatron"), "ref": str(out / "megatron-ref"),
                        "in_place": str(out / "megatron-in-place"),
                        "rounds": str(out / "megatron-rounds"),
                        "logits": str(out / "megatron-logits.safetensors")},
           "mx": {"dir": str(out / "mx")}, "fail_dir": str(out / "fail"), "kill_dir": str(out / "kill"),
           "vllm_save": str(out / "vllm-save")}
    results = launch(job, 2, timeout=150, program=str(PROGRAM),
                     env={"PYTHONPATH": os.pathsep.join([str(PROGRAM.parent), os.environ.get("PYTHONPATH", "")])})
    return results, job


def _report(results, rank: int) -> dict:
    r = results[rank]
    assert r.result is not None, f"rank {rank} left no report (exit {r.returncode}):\n{r.stderr[-3000:]}"
    assert r.result.get("ok"), f"rank {rank}: {r.result.get('error')}\n{r.result.get('trace', '')[-3000:]}"
    return r.result


# ---- load: a save_pretrained Llama into vLLM / Megatron / HF layouts on 2 gloo ranks --------------------

def test_a_sharded_hf_llama_loads_exactly_into_vllm_megatron_and_hf_layouts_on_gloo(launched, llama):
    results, _ = launched
    _, layouts, state = llama
    for rank in (0, 1):
        loaded = _report(results, rank)["loaded"]
        for kind in ("vllm", "megatron", "hf", "vllm_exchange"):
            layout = load_layout(layouts[kind.split("_")[0]], {})
            elements = sum(math.prod(t.local_shape_at(rank)) for t in layout.tensors if t.holds(rank))
            assert loaded[kind]["checked"] == elements, (kind, rank)  # every element of every tensor
        for kind in ("vllm", "megatron", "hf"):  # each rank read its own elements, padding not at all
            assert loaded[kind]["read_bytes"] == loaded[kind]["own_bytes"], (kind, rank, loaded[kind])
            assert loaded[kind]["received_bytes"] == 0
    # exchange=True: every byte of the checkpoint is read once in the whole job (each key by one rank),
    # and what a rank did not read itself reached it over the group
    exchange = [_report(results, r)["loaded"]["vllm_exchange"] for r in (0, 1)]
    assert sum(e["read_bytes"] for e in exchange) == sum(t.numel() * 2 for t in state.values()), exchange
    assert all(0 < e["received_bytes"] < e["own_bytes"] for e in exchange), exchange


def test_a_misshapen_destination_fails_the_group_and_is_not_written(launched):
    results, _ = launched
    bad, other = _report(results, 1)["bad_shape"], _report(results, 0)["bad_shape"]
    assert bad["raised"] == "RefitError" and "model.layers.1.mlp.up_proj.weight" in bad["message"], bad
    assert "49" in bad["message"] and "48" in bad["message"], bad["message"]  # actual and expected shape
    assert bad["untouched"], "rank 1 wrote into its tensors although one of them was misshapen"
    assert other["raised"] == "RefitError" and "failed" in other["message"], other


def test_kv_heads_are_replicated_when_tp_exceeds_them(llama):
    """vLLM TP4 of 2 kv heads: rank r holds q head r and kv head r // 2 (one process, rank= per rank)."""
    folder, layouts, _ = llama
    full = read_checkpoint(str(folder))
    layout = load_layout(layouts["vllm4"], {})
    for rank in range(4):
        dst = garbage(layout, rank)
        load(folder, layout, dst, rank=rank)
        check_all(dst, vllm_expected(full, rank, 4, LLAMA), f"vllm TP4 rank {rank}")


# ---- save: FSDP2 and Megatron trainers write what save_pretrained writes ------------------------------

def _contents(folder) -> dict:
    """{key: (safetensors dtype, shape, raw bytes, file)} of every *.safetensors file, read by safe_open."""
    out = {}
    for path in sorted(Path(folder).glob("*.safetensors")):
        with safe_open(str(path), "pt") as f:
            for key in f.keys():
                t = f.get_tensor(key)
                out[key] = (f.get_slice(key).get_dtype(), tuple(t.shape),
                            t.contiguous().view(torch.uint8).reshape(-1), path.name)
    return out


def _check_same_checkpoint(saved, reference, max_shard_size: int, same_files: bool) -> None:
    """Keys, dtypes, shapes and bytes of every tensor as save_pretrained wrote them; the index names
    each key's file; files cut at max_shard_size (a file over it holds one key). `same_files`: the
    layout lists the keys in the model's order, so the files and index are save_pretrained's too."""
    got, want = _contents(saved), _contents(reference)
    assert sorted(got) == sorted(want)
    for key, (dt, shape, data, _) in want.items():
        assert got[key][:2] == (dt, shape), key
        assert torch.equal(got[key][2], data), f"{key}: bytes differ"
    files = {f for *_, f in got.values()}
    assert len(files) > 1
    index = json.loads((Path(saved) / INDEX).read_text())
    assert index["weight_map"] == {k: v[3] for k, v in got.items()}
    ref_index = json.loads((Path(reference) / INDEX).read_text())
    assert index["metadata"]["total_size"] == ref_index["metadata"]["total_size"]
    if same_files:
        assert index == ref_index
    for name in files:
        keys = [k for k, v in got.items() if v[3] == name]
        assert len(keys) == 1 or sum(got[k][2].numel() for k in keys) <= max_shard_size, name
    assert not [n for n in os.listdir(saved) if n.startswith(".layoutlang-partial-")]


def _logits(folder, tokens) -> torch.Tensor:
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32,
                                                              attn_implementation="eager").eval()
    with torch.no_grad():
        return model(tokens).logits


def _trainer_logits(path):
    with safe_open(path, "pt") as f:
        return f.get_tensor("tokens"), f.get_tensor("logits")


@pytest.mark.parametrize("kind", ["fp32", "bf16"])
def test_an_fsdp2_trainer_saves_what_save_pretrained_writes(launched, kind):
    results, job = launched
    assert _report(results, 0)["fsdp2_load_checked"] > 0 and _report(results, 1)["fsdp2_load_checked"] > 0
    out = job["fsdp2"]
    _check_same_checkpoint(out[kind], out[kind + "_ref"], 4000, same_files=True)
    tokens, trainer = _trainer_logits(out["logits"])
    got = _logits(out[kind], tokens)
    assert torch.equal(got, _logits(out[kind + "_ref"], tokens))
    if kind == "fp32":
        assert torch.allclose(got, trainer, atol=1e-5, rtol=0), (got - trainer).abs().max()


def test_a_megatron_tp2_trainer_saves_what_save_pretrained_writes(launched):
    results, job = launched
    report = _report(results, 0)
    assert report["megatron_ref_vs_megatron"] <= 1e-5  # the hand un-fusing is right: Megatron agrees
    out = job["megatron"]
    _check_same_checkpoint(out["dir"], out["ref"], 16000, same_files=False)  # the bridge's key order
    # the column-parallel keys (Megatron's linear_proj and linear_fc2 split their inputs: a short
    # run per row on each rank) were written by rows, a block per rank; saved in place, the same bytes
    column = sorted(f"model.layers.{l}.{k}.weight" for l in range(2) for k in ("self_attn.o_proj", "mlp.down_proj"))
    assert [sorted(_report(results, r)["megatron"]["exchanged"]) for r in range(2)] == [column, column]
    assert _report(results, 0)["megatron_in_place"]["exchanged"] == []
    _check_same_checkpoint(out["in_place"], out["ref"], 16000, same_files=False)
    _check_same_checkpoint(out["rounds"], out["ref"], 16000, same_files=False)  # one key per round, links
    assert _report(results, 0)["megatron_rounds"]["transport"] == "links"
    assert _report(results, 0)["megatron"]["transport"] in ("memory", "links")  # which: test_checkpoint_rules
    tokens, trainer = _trainer_logits(out["logits"])
    got = _logits(out["dir"], tokens)
    assert torch.equal(got, _logits(out["ref"], tokens))
    assert (got - trainer).abs().max() <= 1e-5 and trainer.abs().max() > 0.1


def _mx_reference(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    ref = quantize_mxfp8(t.float().tolist())
    return torch.tensor(ref.codes, dtype=torch.uint8), torch.tensor(ref.scales, dtype=torch.uint8)


def test_a_tp2_layout_saves_mxfp8_data_and_e8m0_scales_and_plain_keys(launched):
    results, job = launched
    _report(results, 0)
    got = _contents(job["mx"]["dir"])
    for name, whole in zip(("w", "u"), mx_values()):
        codes, scales = _mx_reference(whole)  # 32-blocks along the last dim: the shards' blocks are the whole's
        assert got[name][:2] == ("F8_E4M3", tuple(whole.shape))
        assert got[name + "_scale"][:2] == ("U8", (whole.shape[0], whole.shape[1] // 32))
        assert torch.equal(got[name][2], codes.reshape(-1)), name
        assert torch.equal(got[name + "_scale"][2], scales.reshape(-1)), name
    for name, whole in plain_values().items():
        assert got[name][:2] == ("F32", tuple(whole.shape))
        assert torch.equal(got[name][2], whole.view(torch.uint8).reshape(-1)), name
    assert sorted(got) == ["big", "rep", "u", "u_scale", "w", "w_scale"]


# ---- save failures ------------------------------------------------------------------------------------

def _published(folder) -> list[str]:
    return sorted(n for n in os.listdir(folder) if n.endswith(".safetensors") or n == INDEX)


def test_a_save_that_fails_on_one_rank_publishes_nothing(launched):
    results, job = launched
    failed, other = _report(results, 0)["save_raises"], _report(results, 1)["save_raises"]
    assert failed["raised"] == "RuntimeError" and "injected" in failed["message"]
    assert other["raised"] == "RefitError" and "nothing was saved" in other["message"], other
    assert not os.path.exists(job["fail_dir"])  # the save made the directory: it leaves none behind


def test_vllm_tp2_shards_save_without_a_config_what_save_pretrained_wrote(launched, llama):
    """`layoutc new vllm --set TP=2` shards (rotary halves in their qkv_proj) saved into a directory
    that did not exist, without config.json or `config=`: every key's dtype, shape and bytes are
    save_pretrained's, files cut at 10 KB, and the model read back gives save_pretrained's logits."""
    results, job = launched
    folder, _, _ = llama
    for rank in (0, 1):
        assert _report(results, rank)["vllm_save"]["written"] > 0
    saved = Path(job["vllm_save"])
    _check_same_checkpoint(saved, folder, 10_000, same_files=False)
    shutil.copy(folder / "config.json", saved / "config.json")  # weights only: the config is the caller's
    tokens = _tokens(LLAMA["V"])
    assert torch.equal(_logits(saved, tokens), _logits(folder, tokens))


def test_a_save_killed_halfway_publishes_nothing_and_the_other_rank_raises(launched):
    results, job = launched
    dead = results[1]
    assert dead.returncode == 1 and dead.result and dead.result.get("killed"), dead.stderr[-2000:]
    survivor = _report(results, 0)["save_killed"]
    assert survivor["raised"] is not None, "rank 0 finished a save whose other rank died"
    folder = job["kill_dir"]
    assert _published(folder) == [], os.listdir(folder)
    assert all(n.startswith(".layoutlang-partial-") for n in os.listdir(folder)), os.listdir(folder)


def test_a_target_that_holds_a_checkpoint_is_refused_unless_overwrite(tmp_path, llama):
    folder, _, _ = llama
    target = tmp_path / "t"
    shutil.copytree(folder, target)
    before = {n: (target / n).read_bytes() for n in os.listdir(target)}
    layout = loads("layout one\nmesh m (r=1)\ntensor a [8, 4] fp32\ntensor b [6, 4] fp32\n", "<one>")
    tensors = {"a": torch.arange(32, dtype=torch.float32).reshape(8, 4), "b": torch.ones(6, 4)}
    with pytest.raises(UsageError, match="overwrite"):
        save(target, layout, tensors)
    assert {n: (target / n).read_bytes() for n in os.listdir(target)} == before
    save(target, layout, tensors, overwrite=True)
    assert _published(target) == ["model.safetensors"]  # the old shards and index are gone
    assert (target / "config.json").read_bytes() == before["config.json"]
    got = read_checkpoint(str(target))
    assert sorted(got) == ["a", "b"] and torch.equal(got["a"], tensors["a"]) and torch.equal(got["b"], tensors["b"])


# ---- quantized loads and saves in one process ---------------------------------------------------------

QUANT_DST = """
layout quant_dst
mesh m (tp=2)
tensor w [128 over tp, 64] mxfp8
tensor w2 [260 over tp, 130] fp8_b128
"""


def _values(shape, seed) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    t = torch.randn(*shape, generator=g) * torch.logspace(-4, 3, shape[-1])
    return t.to(torch.bfloat16)


def test_a_bf16_checkpoint_loads_into_mxfp8_and_fp8_b128_as_the_reference_quantizes(tmp_path):
    w, w2 = _values((128, 64), 1), _values((260, 130), 2)
    w[7, 32:] = 0  # an all-zero block
    w2[258:] *= 1e-3  # rank 1's partial second block row (2 rows): small values, scales of their own
    save_file({"w": w, "w2": w2}, str(tmp_path / "model.safetensors"))
    layout = loads(QUANT_DST, "<quant>")
    for rank in (0, 1):
        junk = lambda shape, dt, v: torch.full(shape, v, dtype=torch.uint8).view(dt)  # noqa: E731
        dst = {"w": (junk((64, 64), torch.float8_e4m3fn, 0x35), junk((64, 2), torch.uint8, 0xAB)),
               "w2": (junk((130, 130), torch.float8_e4m3fn, 0x35), torch.full((2, 2), 7.0))}  # partial edges
        load(tmp_path, layout, dst, rank=rank)
        codes, scales = _mx_reference(w[rank * 64:(rank + 1) * 64])
        assert torch.equal(dst["w"][0].view(torch.uint8), codes), f"mxfp8 data, rank {rank}"
        assert torch.equal(dst["w"][1], scales), f"mxfp8 scales, rank {rank}"
        ref = quantize_fp8_b128(w2[rank * 130:(rank + 1) * 130].float().tolist())
        assert torch.equal(dst["w2"][0].view(torch.uint8), torch.tensor(ref.codes, dtype=torch.uint8)), rank
        assert torch.equal(dst["w2"][1], torch.tensor(ref.scales, dtype=torch.float32)), f"fp8_b128 scales {rank}"


def test_a_deepseek_fp8_b128_checkpoint_loads_dequantized_into_bf16(tmp_path):
    x = _values((136, 130), 3)
    ref = quantize_fp8_b128(x.float().tolist())
    codes = torch.tensor(ref.codes, dtype=torch.uint8)
    scale_inv = torch.tensor(ref.scales, dtype=torch.float32)
    assert scale_inv.shape == (2, 2)  # ceil(136 / 128), ceil(130 / 128)
    save_file({"model.w": codes.view(torch.float8_e4m3fn), "model.w_scale_inv": scale_inv,
               "model.b": x[0].clone()}, str(tmp_path / "model.safetensors"))
    # DeepSeek-V3's weight_dequant: value = fp8 value x the fp32 multiplier of its 128 x 128 block
    per_element = scale_inv.repeat_interleave(128, 0)[:136].repeat_interleave(128, 1)[:, :130]
    want = (codes.view(torch.float8_e4m3fn).float() * per_element).to(torch.bfloat16)
    layout = loads("layout dq\nmesh m (tp=2)\ntensor model.w [136 over tp, 130] bf16\ntensor model.b [130] bf16\n",
                   "<dq>")
    for rank in (0, 1):
        dst = garbage(layout, rank)
        load(tmp_path, layout, dst, rank=rank)
        assert torch.equal(dst["model.w"], want[rank * 68:(rank + 1) * 68]), rank
        assert torch.equal(dst["model.b"], x[0])


def test_save_quantizes_bf16_into_mxfp8_files(tmp_path):
    w = _values((32, 96), 4)
    layout = loads("layout q\nmesh m (r=1)\ntensor w [32, 96] bf16\n", "<q>")
    save(tmp_path, layout, {"w": w}, dtype="mxfp8")
    got = _contents(tmp_path)
    codes, scales = _mx_reference(w)
    assert got["w"][:2] == ("F8_E4M3", (32, 96)) and torch.equal(got["w"][2], codes.reshape(-1))
    assert got["w_scale"][:2] == ("U8", (32, 3)) and torch.equal(got["w_scale"][2], scales.reshape(-1))


def test_a_save_is_byte_for_byte_what_safetensors_writes_of_the_same_tensors(tmp_path):
    """The whole file, header and data, against safetensors' own `save_file` (what `save_pretrained`
    calls): keys in the layout out of name order, five dtypes (fp32, bf16, fp16 and mxfp8's F8_E4M3
    codes + U8 scales: saved with dtype="mxfp8", which only b.w can hold), an upper-case name (bytes order it before every lower-case one)."""
    from safetensors.torch import save_file

    layout = loads("layout mixed\nmesh m (r=1)\ntensor z.norm [6] fp32\ntensor b.w [32, 64] bf16\n"
                   "tensor a.w [4, 3] bf16\ntensor m.h [5] fp16\ntensor c.w [2, 2] fp32\n"
                   "tensor Q.w [3] bf16\n", "<mixed>")
    g = torch.Generator().manual_seed(7)
    tensors = {"z.norm": torch.randn(6, generator=g), "b.w": _values((32, 64), 9),
               "a.w": torch.randn(4, 3, generator=g).to(torch.bfloat16),
               "m.h": torch.randn(5, generator=g).to(torch.float16), "c.w": torch.randn(2, 2, generator=g),
               "Q.w": torch.randn(3, generator=g).to(torch.bfloat16)}
    save(tmp_path / "ours", layout, tensors, dtype="mxfp8")  # b.w alone can hold it
    codes, scales = _mx_reference(tensors["b.w"])
    theirs = {k: v for k, v in tensors.items() if k != "b.w"}
    theirs["b.w"] = codes.view(torch.float8_e4m3fn).reshape(32, 64)
    theirs["b.w_scale"] = scales.reshape(32, 2)
    save_file(theirs, str(tmp_path / "theirs.safetensors"), metadata={"format": "pt"})
    assert (tmp_path / "ours" / "model.safetensors").read_bytes() == (tmp_path / "theirs.safetensors").read_bytes()


# ---- hostile inputs through load ----------------------------------------------------------------------

def test_a_key_the_layout_needs_and_the_checkpoint_lacks_is_named_at_its_layout_line(tmp_path, llama):
    folder, layouts, state = llama
    missing = "model.layers.1.mlp.up_proj.weight"
    save_file({k: v for k, v in state.items() if k != missing}, str(tmp_path / "model.safetensors"))
    shutil.copy(folder / "config.json", tmp_path)  # q/k rows as rotary halves, as the layout writes them
    layout = load_layout(layouts["vllm"], {})
    dst = garbage(layout, 0)
    with pytest.raises(PlanError) as info:
        load(tmp_path, layouts["vllm"], dst, rank=0)
    e = info.value
    assert missing in e.message
    lines = Path(layouts["vllm"]).read_text().splitlines()
    assert e.file == layouts["vllm"] and "mlp.gate_up_proj.weight" in lines[e.line - 1], (e.file, e.line)
    assert all(bool(torch.isnan(t).all()) for t in dst.values())


def test_a_truncated_data_file_is_a_checkpoint_error_naming_it(tmp_path, llama):
    folder, layouts, _ = llama
    target = tmp_path / "ck"
    shutil.copytree(folder, target)
    victim = sorted(target.glob("*.safetensors"))[1]
    with open(victim, "r+b") as fh:
        fh.truncate(victim.stat().st_size - 3)
    layout = load_layout(layouts["hf"], {})
    dst = garbage(layout, 0)
    with pytest.raises(CheckpointError) as info:
        load(target, layout, dst, rank=0)
    assert victim.name in str(info.value)
    assert all(bool(torch.isnan(t).all()) for t in dst.values())


def test_a_misshapen_destination_in_one_process_names_it_and_writes_nothing(llama):
    folder, layouts, _ = llama
    layout = load_layout(layouts["vllm"], {})
    dst = garbage(layout, 1)
    dst["model.layers.0.self_attn.qkv_proj.weight"] = torch.full((31, LLAMA["H"]), float("nan"),
                                                                 dtype=TORCH_DTYPE["bf16"])
    with pytest.raises(RefitError, match=r"model\.layers\.0\.self_attn\.qkv_proj\.weight"):
        load(folder, layout, dst, rank=1)
    assert all(bool(torch.isnan(t).all()) for t in dst.values())
