"""A checkpoint as a side of `layoutc plan` / `explain`, and `layoutc convert` (docs/cli.md).

References, independent of the code under test:
- the plans of a small checkpoint worked out by hand from the layouts (LANGUAGE.md 3):
  which rows and columns each rank holds, one op per (key, receiving rank, source
  block), bytes = elements x width (bf16 2, fp32 4), padding never sent;
- `safetensors` (`save_file` writes every source, `safe_open` reads what a conversion
  wrote); fp8_b128 dequantized by hand (each element times the fp32 scale of its
  128 x 128 block, in fp32, then bf16); mxfp8 from tests/reference_quant.py (exact
  rationals, OCP MX rules).
"""

import json
import re

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from layoutlang.cli import main
from reference_quant import quantize_mxfp8

Q, K, V = (f"model.layers.0.self_attn.{p}_proj.weight" for p in "qkv")
EMBED, NORM, HEAD = "model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"

# The engine: TP2, the embedding's 10 rows padded to 12 (6 per rank), q|k|v fused per rank.
INFER = f"""mesh infer (tp=2)
tensor {EMBED} [10 pad 4 over tp, 8]
tensor model.layers.0.self_attn.qkv_proj.weight [(q: 8 as {Q} | k: 4 as {K} | v: 4 as {V}) over tp, 8]
tensor {NORM} [8] fp32
"""
# The trainer: every key of the checkpoint; v replicated, lm_head split by columns.
TRAIN = f"""mesh train (tp=2)
tensor {EMBED} [10 pad 4 over tp, 8]
tensor {Q} [8 over tp, 8]
tensor {K} [4 over tp, 8]
tensor {V} [4, 8]
tensor {NORM} [8] fp32
tensor {HEAD} [10, 8 over tp]
"""


def _weights():
    g = torch.Generator().manual_seed(0)
    return {EMBED: torch.randn(10, 8, generator=g).bfloat16(), Q: torch.randn(8, 8, generator=g).bfloat16(),
            K: torch.randn(4, 8, generator=g).bfloat16(), V: torch.randn(4, 8, generator=g).bfloat16(),
            NORM: torch.randn(8, generator=g), HEAD: torch.randn(10, 8, generator=g).bfloat16(),
            "position_ids": torch.arange(6).reshape(1, 6)}  # I64: no layout dtype, skipped


@pytest.fixture
def ck(tmp_path, monkeypatch):
    """A HF-style checkpoint folder `ck/`, the two layouts beside it; cwd is tmp_path."""
    (tmp_path / "ck").mkdir()
    save_file(_weights(), str(tmp_path / "ck" / "model.safetensors"))
    (tmp_path / "infer.layout").write_text(INFER)
    (tmp_path / "train.layout").write_text(TRAIN)
    monkeypatch.chdir(tmp_path)
    return tmp_path


def _run(capsys, *argv):
    code = main(list(argv))
    got = capsys.readouterr()
    return code, got.out, got.err


def _ops(out: str) -> set:
    plan = json.loads(out)
    return {(op["key"], op["src_rank"], op["dst_rank"], tuple(map(tuple, op["src_slice"])),
             tuple(map(tuple, op["dst_slice"])), op["bytes"]) for op in plan["ops"]}


# By hand, the load ck -> INFER: each rank reads its own rows, so every op stays on its rank.
# embed: rank 0 rows 0:6 (96 B), rank 1 rows 6:10 into its rows 0:4 (64 B; 2 padding rows get nothing);
# q 4 rows, k 2, v 2 per rank, at rows 0, 4, 6 of the rank's qkv; the fp32 norm whole on both.
LOAD_OPS = {
    (EMBED, 0, 0, ((0, 6), (0, 8)), ((0, 6), (0, 8)), 96), (EMBED, 1, 1, ((6, 10), (0, 8)), ((0, 4), (0, 8)), 64),
    (Q, 0, 0, ((0, 4), (0, 8)), ((0, 4), (0, 8)), 64), (Q, 1, 1, ((4, 8), (0, 8)), ((0, 4), (0, 8)), 64),
    (K, 0, 0, ((0, 2), (0, 8)), ((4, 6), (0, 8)), 32), (K, 1, 1, ((2, 4), (0, 8)), ((4, 6), (0, 8)), 32),
    (V, 0, 0, ((0, 2), (0, 8)), ((6, 8), (0, 8)), 32), (V, 1, 1, ((2, 4), (0, 8)), ((6, 8), (0, 8)), 32),
    (NORM, 0, 0, ((0, 8),), ((0, 8),), 32), (NORM, 1, 1, ((0, 8),), ((0, 8),), 32)}
# rank 0: 96 + 64 + 32 + 32 + 32 = 256 B; rank 1: 64 + 64 + 32 + 32 + 32 = 224 B
LOAD_BYTES = 480


# ---- layoutc plan DIR LAYOUT: the preview of a load ------------------------------------------------

def test_plan_of_a_checkpoint_previews_the_load(ck, capsys):
    code, out, err = _run(capsys, "plan", "ck", "infer.layout")
    assert code == 0, err
    assert out.startswith("plan <checkpoint ck> (checkpoint) -> infer.layout\n")
    for line in ("  source       ranks 0..1", "  destination  ranks 0..1", "  ops          10",
                 f"  bytes        {LOAD_BYTES} B ({LOAD_BYTES} B)", f"  local        {LOAD_BYTES} B (copies on the same rank)",
                 "  network      0 B", "  rank 0            256 B", "  rank 1            224 B",
                 "  (none: every byte is a local copy)"):
        assert line in out.splitlines(), (line, out)
    # the key the engine does not take; position_ids (I64) is no key of the checkpoint's layout at all
    assert err.strip() == f"warning: 1 source key is not in the destination: {HEAD}"


def test_json_of_a_load_is_the_hand_computed_ops_and_plan_load_s_plan(ck, capsys):
    from layoutlang.checkpoint import plan_load

    code, out, _ = _run(capsys, "plan", "ck", "infer.layout", "--format", "json")
    assert code == 0
    plan = json.loads(out)
    assert _ops(out) == LOAD_OPS
    assert all(op["src_rank"] == op["dst_rank"] for op in plan["ops"])  # every op local
    assert plan["stats"]["bytes"] == LOAD_BYTES and plan["stats"]["network_bytes"] == 0
    assert plan["src"]["ranks"] == [0, 1] and plan["unused_keys"] == [HEAD]
    assert plan["digest"] == plan_load("ck", "infer.layout")[1].digest  # what `load` runs
    # one .safetensors file is a checkpoint side too; --rank filters as for any pair
    code, one, _ = _run(capsys, "plan", "ck/model.safetensors", "infer.layout", "--format", "json")
    assert code == 0 and _ops(one) == LOAD_OPS
    code, rank1, _ = _run(capsys, "plan", "ck", "infer.layout", "--format", "json", "--rank", "1")
    assert code == 0 and _ops(rank1) == {op for op in LOAD_OPS if op[2] == 1}


def test_a_checkpoint_destination_is_one_rank_holding_every_key(ck, capsys):
    # By hand, TRAIN -> ck (every key whole on rank 0): rank 0's own halves are local, rank 1's cross.
    # embed 96 local + 64 network; q 64 + 64; k 32 + 32; v (both hold it) 64 local; norm 32 local;
    # lm_head columns 0:4 local 80, 4:8 network 80. 608 B in 10 ops, 368 local, 240 over the network.
    code, out, err = _run(capsys, "plan", "train.layout", "ck", "--format", "json")
    assert code == 0, err
    plan = json.loads(out)
    assert {op["dst_rank"] for op in plan["ops"]} == {0} and plan["dst"]["ranks"] == [0]
    assert (plan["stats"]["ops"], plan["stats"]["bytes"]) == (10, 608)
    assert (plan["stats"]["local_bytes"], plan["stats"]["network_bytes"]) == (368, 240)
    assert sorted(op["bytes"] for op in plan["ops"] if op["src_rank"] == 1) == [32, 64, 64, 80]


def test_html_dot_and_explain_take_a_checkpoint_side(ck, capsys):
    code, out, _ = _run(capsys, "plan", "ck", "infer.layout", "--format", "html")
    assert code == 0 and out.lstrip().lower().startswith("<!doctype html")
    code, out, _ = _run(capsys, "plan", "ck", "infer.layout", "--format", "dot")
    assert code == 0 and out.startswith("digraph")
    code, out, _ = _run(capsys, "explain", "ck", "infer.layout", NORM)
    assert code == 0
    assert f"source <checkpoint ck>: {NORM}  fp32 on mesh checkpoint (reader=2)" in out
    assert "\n2 ops\n" in out  # the norm, whole, to each rank
    code, out, _ = _run(capsys, "explain", "ck", K)  # one side: the checkpoint's own layout
    assert code == 0 and "on mesh checkpoint (one=1)  local [4, 8]" in out


def test_a_key_the_checkpoint_lacks_is_a_diagnostic_naming_it(ck, capsys):
    (ck / "bad.layout").write_text(INFER + "tensor rotary.inv_freq [8]\n")
    code, _, err = _run(capsys, "plan", "ck", "bad.layout")
    assert code == 1
    assert err == ("bad.layout:5:1: error: key `rotary.inv_freq` is not in the checkpoint ck\n"
                   "    5 | tensor rotary.inv_freq [8]\n"
                   "      | ^^^^^^^^^^^^^^^^^^^^^^^^^^\n"
                   "help: give the tensor the source's key with `as KEY`\n")


def test_a_key_the_checkpoint_skips_says_why(ck, capsys):
    (ck / "ids.layout").write_text("mesh m (one=1)\ntensor position_ids [1, 6]\n")
    code, _, err = _run(capsys, "plan", "ck", "ids.layout")
    assert code == 1
    assert err.startswith("ids.layout:2:1: error: key `position_ids` is not in the checkpoint ck\n")
    assert ("note: the checkpoint has `position_ids` (I64 [1, 6] in model.safetensors) but leaves it out: "
            "I64: the layout language has no integer dtype\n") in err


def test_a_checkpoint_key_the_source_lacks_points_at_the_checkpoint(ck, capsys):
    from layoutlang.checkpoint import describe

    (ck / "short.layout").write_text(TRAIN.replace(f"tensor {HEAD} [10, 8 over tp]\n", ""))
    line = describe("ck").text.splitlines().index(f"tensor {HEAD} [10, 8]") + 1
    code, _, err = _run(capsys, "plan", "short.layout", "ck")
    assert code == 1
    head, snippet, caret, help_ = err.splitlines()
    assert head == f"<checkpoint ck>:{line}:1: error: key `{HEAD}` is not in the source layout short.layout"
    assert snippet.endswith(f"| tensor {HEAD} [10, 8]") and caret.endswith("| " + "^" * len(f"tensor {HEAD} [10, 8]"))
    assert help_.startswith("help: a checkpoint destination takes every key it holds")
    assert "`layoutc new checkpoint ck -o ckpt.layout`" in help_


def test_args_of_a_pair_with_a_checkpoint(ck, capsys):
    (ck / "tp.layout").write_text(INFER.replace("mesh infer (tp=2)", "arg TP = 2\nmesh infer (tp=TP)"))
    code, out, err = _run(capsys, "plan", "ck", "tp.layout", "--set", "TP=1", "--format", "json")
    assert code == 0, err
    plan = json.loads(out)
    assert plan["src"]["ranks"] == [0] and plan["dst"]["ranks"] == [0] and plan["stats"]["ops"] == 5
    assert "note: --set TP=1 applies to both layouts; taken by tp.layout" in err
    code, _, err = _run(capsys, "plan", "ck", "tp.layout", "--set-dst", "TP=1")
    assert code == 0
    for argv, message in ((["--set-src", "TP=1"], "error: --set-src TP: ck is a checkpoint, which has no args"),
                          (["--set", "XX=1"], "error: --set XX: neither layout has an arg `XX` (a checkpoint has none)"),
                          (["--set-dst", "XX=1"], "error: --set-dst XX: tp.layout has no arg `XX`")):
        code, _, err = _run(capsys, "plan", "ck", "tp.layout", *argv)
        assert (code, err.splitlines()[0]) == (2, message)


def test_usage_errors_with_a_checkpoint_side(ck, capsys):
    code, _, err = _run(capsys, "plan", "missing.safetensors", "infer.layout")
    assert code == 2 and "missing.safetensors: not a directory of safetensors files" in err
    (ck / "empty").mkdir()
    code, _, err = _run(capsys, "plan", "empty", "infer.layout")
    assert code == 2 and "no *.safetensors file" in err
    code, _, err = _run(capsys, "run", "ck", "infer.layout", "--nproc", "2")
    assert code == 2 and "`layoutc run` fills and checks layouts with generated data, not a checkpoint" in err
    assert "help: preview a load with `layoutc plan ck LAYOUT`" in err


# ---- layoutc convert -----------------------------------------------------------------------------------

def _dequantize_b128(data: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """By hand: every element times the scale of its 128 x 128 block, in fp32, then bf16."""
    out = torch.empty(data.shape, dtype=torch.float32)
    values = data.to(torch.float32)
    for i in range(0, data.shape[0], 128):
        for j in range(0, data.shape[1], 128):
            out[i:i + 128, j:j + 128] = values[i:i + 128, j:j + 128] * scale[i // 128, j // 128]
    return out.to(torch.bfloat16)


def _fp8_source(folder):
    """A small checkpoint with an fp8_b128 key (DeepSeek-V3's `weight_scale_inv`), two bf16 keys and an fp32
    one; 130 x 200 has a 2 x 2 scale grid whose last row and column of blocks are partial."""
    g = torch.Generator().manual_seed(1)
    src = {"b.weight": ((torch.rand(130, 200, generator=g) * 2 - 1) * 448).to(torch.float8_e4m3fn),
           "b.weight_scale_inv": torch.rand(2, 2, generator=g) + 0.01,
           "a.weight": torch.randn(6, 64, generator=g).bfloat16(),
           "c.weight": (torch.randn(4, 128, generator=g) * torch.logspace(-3, 3, 128)).bfloat16(),
           "n.weight": torch.randn(64, generator=g),
           "extra.weight": torch.randn(2, 2, generator=g).bfloat16()}
    folder.mkdir()
    save_file(src, str(folder / "model.safetensors"))
    return src


# TP2: a.weight cast to fp32; b.weight dequantized to bf16, columns split; c.weight quantized to mxfp8,
# each rank 64 columns = 2 whole 32-element blocks; n.weight replicated; extra.weight not taken.
TO = """mesh m (tp=2)
tensor a.weight [6 over tp, 64] fp32
tensor b.weight [130, 200 over tp]
tensor c.weight [4, 128 over tp] mxfp8
tensor n.weight [64] fp32
"""


@pytest.mark.timeout(120)
def test_convert_on_two_processes_casts_dequantizes_and_quantizes(tmp_path, monkeypatch, capsys):
    src = _fp8_source(tmp_path / "src")
    (tmp_path / "to.layout").write_text(TO)
    monkeypatch.chdir(tmp_path)
    code, out, err = _run(capsys, "convert", "src", "-o", "out", "--to", "to.layout", "--nproc", "2",
                          "--max-shard-size", "20KB", "--timeout", "60")
    assert code == 0, err
    assert err.strip() == "warning: 1 checkpoint key is not in to.layout, not written: extra.weight"
    # b.weight (130 x 200 bf16 = 52,000 B) is above 20 KB: a file of its own; the others share one; an index
    names = sorted(p.name for p in (tmp_path / "out").iterdir())
    assert names == ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors",
                     "model.safetensors.index.json"]
    size = sum((tmp_path / "out" / n).stat().st_size for n in names)
    assert re.fullmatch(rf"wrote out: 3 files, \S+ \S+ \({size} B\), 4 keys of to\.layout, in [0-9.]+ s on 2 processes\n",
                        out), out
    index = json.loads((tmp_path / "out" / "model.safetensors.index.json").read_text())
    got, dtypes = {}, {}
    for name in names[:2]:
        with safe_open(str(tmp_path / "out" / name), "pt") as fh:
            for key in fh.keys():
                assert index["weight_map"][key] == name
                got[key], dtypes[key] = fh.get_tensor(key), fh.get_slice(key).get_dtype()
    assert dtypes == {"a.weight": "F32", "b.weight": "BF16", "c.weight": "F8_E4M3", "c.weight_scale": "U8",
                      "n.weight": "F32"}
    assert torch.equal(got["a.weight"], src["a.weight"].float())
    assert torch.equal(got["n.weight"], src["n.weight"])
    assert torch.equal(got["b.weight"], _dequantize_b128(src["b.weight"], src["b.weight_scale_inv"]))
    ref = quantize_mxfp8(src["c.weight"].float().tolist())
    assert got["c.weight"].view(torch.uint8).tolist() == ref.codes
    assert got["c.weight_scale"].tolist() == ref.scales


def test_convert_in_process_dtype_bf16_dequantizes_the_checkpoint_s_own_layout(tmp_path, monkeypatch, capsys):
    src = _fp8_source(tmp_path / "src")
    monkeypatch.chdir(tmp_path)
    code, out, err = _run(capsys, "convert", "src", "-o", "out", "--dtype", "bf16")
    assert code == 0, err
    assert re.fullmatch(r"wrote out: 1 file, .* 5 keys of the checkpoint as bf16, in [0-9.]+ s on 1 process\n", out), out
    with safe_open(str(tmp_path / "out" / "model.safetensors"), "pt") as fh:
        got = {k: fh.get_tensor(k) for k in fh.keys()}
    assert {k: v.dtype for k, v in got.items()} == {k: torch.bfloat16 for k in src if k != "b.weight_scale_inv"}
    assert torch.equal(got["b.weight"], _dequantize_b128(src["b.weight"], src["b.weight_scale_inv"]))
    for key in ("a.weight", "c.weight", "n.weight", "extra.weight"):
        assert torch.equal(got[key], src[key].bfloat16()), key
    # --overwrite replaces it; without, the folder is refused
    code, _, err = _run(capsys, "convert", "src", "-o", "out", "--dtype", "fp32")
    assert code == 2 and "error: -o out: holds a checkpoint already (model.safetensors)" in err
    assert "help: pass --overwrite to replace it" in err
    # fp32: b.weight is 130 x 200 x 4 = 104,000 B, above 30,000 B (a plain number of bytes): a file of its own
    code, _, err = _run(capsys, "convert", "src", "-o", "out", "--dtype", "fp32", "--overwrite",
                        "--max-shard-size", "30000")
    assert code == 0, err
    index = json.loads((tmp_path / "out" / "model.safetensors.index.json").read_text())
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == sorted({*index["weight_map"].values(),
                                                                           "model.safetensors.index.json"})
    assert len(set(index["weight_map"].values())) == 2 and set(index["weight_map"]) == set(got)
    with safe_open(str(tmp_path / "out" / index["weight_map"]["b.weight"]), "pt") as fh:
        assert list(fh.keys()) == ["b.weight"] and fh.get_slice("b.weight").get_dtype() == "F32"


def test_convert_refuses_before_any_process_starts(tmp_path, monkeypatch, capsys):
    _fp8_source(tmp_path / "src")
    (tmp_path / "to.layout").write_text(TO)
    (tmp_path / "more.layout").write_text(TO + "tensor missing.weight [4]\n")
    monkeypatch.chdir(tmp_path)
    for argv, code, first in (
            (["--to", "to.layout", "--nproc", "3"], 2, "error: --nproc 3: the layout to.layout has 2 ranks, one process each"),
            (["--to", "to.layout", "--set", "TP=2"], 2, "error: --set TP: the layout has no arg `TP`"),
            (["--dtype", "bf17"], 2, "error: --dtype bf17: not a layout dtype"),
            (["--dtype", "nvfp4"], 2, "error: key `n.weight`: nvfp4 has no checkpoint format here"),
            (["--max-shard-size", "5 parsecs"], 2, "error: max_shard_size '5 parsecs': expected bytes"),
            (["--to", "more.layout"], 1, "more.layout:6:1: error: key `missing.weight` is not in the checkpoint src")):
        got, _, err = _run(capsys, "convert", "src", "-o", "out", *argv)
        assert (got, err.splitlines()[0][:len(first)]) == (code, first), err
    code, _, err = _run(capsys, "convert", "src", "-o", "src", "--dtype", "bf16")
    assert code == 2 and "error: -o src: is where the checkpoint src is" in err
    assert not (tmp_path / "out").exists()
