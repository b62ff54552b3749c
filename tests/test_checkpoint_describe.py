"""A checkpoint describes itself (layoutlang.checkpoint, `layoutc new checkpoint DIR`; docs/checkpoints.md).

References, independent of layoutlang.checkpoint:
- files written by the `safetensors` package (`save_file`) and by transformers
  (`save_pretrained`, several shards and an index); keys, shapes and dtypes
  expected from `safe_open` and the model's state_dict, byte ranges checked by
  comparing the file's bytes there with the tensor `safe_open` returns;
- the pairing rules worked out by hand from LANGUAGE.md 4.1 (DeepSeek-V3: one fp32
  scale per 128 x 128 block, so [300, 200] has a [3, 2] grid);
- `layoutc new vllm` / `hf` layouts of the same config and the slow plan
  simulator (tests/plan_simulator.py): every destination element written once;
- hostile files built byte by byte by the small writer below.
"""

import json
import struct

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from layoutlang import compile_plan, loads
from layoutlang.checkpoint import CheckpointError, describe, describe_layout
from layoutlang.cli import main
from plan_simulator import RunsView, check_stats, simulate

# safetensors dtype -> layout dtype, as LANGUAGE.md 4 names them
LAYOUT_DTYPE = {"BF16": "bf16", "F16": "fp16", "F32": "fp32", "F8_E4M3": "fp8_e4m3", "F8_E5M2": "fp8_e5m2"}


def _truth(folder):
    """{key: (safetensors dtype, shape, file)} of every *.safetensors file in `folder`, by safe_open."""
    out = {}
    for path in sorted(folder.glob("*.safetensors")):
        with safe_open(str(path), "pt") as f:
            for key in f.keys():
                s = f.get_slice(key)
                out[key] = (s.get_dtype(), tuple(s.get_shape()), path.name)
    return out


def _layout_tensors(layout):
    return {t.name: (t.key, t.local_shape, t.dtype) for t in layout.tensors}


# ---- plain files written by the safetensors package ---------------------------------------------------

def test_a_file_from_save_file_is_its_own_layout(tmp_path):
    tensors = {"model.embed_tokens.weight": torch.randn(10, 4, dtype=torch.bfloat16),
               "model.norm.weight": torch.randn(4, dtype=torch.float16),
               "lm_head.weight": torch.randn(10, 4),
               "scalar": torch.tensor(3.0),
               "fp8.plain": torch.randn(3, 5).to(torch.float8_e5m2)}
    save_file(tensors, str(tmp_path / "model.safetensors"))
    truth = _truth(tmp_path)
    ckpt = describe(tmp_path)
    got = _layout_tensors(loads(ckpt.text))
    assert got == {k: (k, shape, LAYOUT_DTYPE[dt]) for k, (dt, shape, _) in truth.items()}
    assert ckpt.layout.ranks == 1 and not ckpt.skipped and ckpt.index is None
    # byte ranges: the file's bytes there are the tensor's bytes
    blob = (tmp_path / "model.safetensors").read_bytes()
    for t in ckpt.tensors:
        want = tensors[t.name].reshape(-1).contiguous().view(torch.uint8).numpy().tobytes()
        assert blob[t.data.begin:t.data.end] == want, t.name
        assert t.data.file == "model.safetensors" and t.scales == ()
    assert describe_layout(tmp_path).tensors[0].name == ckpt.layout.tensors[0].name
    assert describe(tmp_path / "model.safetensors").tensors == ckpt.tensors  # one file is a checkpoint too


def test_keys_the_language_cannot_hold_are_skipped_with_a_reason_and_odd_names_renamed(tmp_path):
    save_file({"position_ids": torch.arange(6).reshape(1, 6), "mask": torch.ones(2, 2, dtype=torch.bool),
               "w-1/x": torch.zeros(2, 3), "w_1_x": torch.zeros(3), "a..b": torch.zeros(2), "empty": torch.zeros(0, 4),
               "f64": torch.zeros(2, dtype=torch.float64)}, str(tmp_path / "m.safetensors"))
    ckpt = describe(tmp_path)
    layout = loads(ckpt.text)
    assert {s.entry.key: s.reason.split(":")[0] for s in ckpt.skipped} == {
        "position_ids": "I64", "mask": "BOOL", "f64": "F64", "empty": "an empty tensor [0, 4]"}
    assert "no integer dtype" in next(s.reason for s in ckpt.skipped if s.entry.key == "position_ids")
    assert '# skipped "position_ids" I64 [1, 6]' in ckpt.text
    names = {t.data.key: t.name for t in ckpt.tensors}
    assert names["w_1_x"] == "w_1_x" and names["w-1/x"] == "w_1_x_2" and names["a..b"] == "a._.b"
    assert sorted(t.name for t in layout.tensors) == sorted(names.values())
    assert '# renamed from "w-1/x"' in ckpt.text


# ---- quantized checkpoints: scales pair with their data --------------------------------------------------

def test_scale_tensors_pair_as_the_languages_block_scaled_formats(tmp_path):
    save_file({
        # DeepSeek-V3: fp8 e4m3 + fp32 weight_scale_inv, one per 128 x 128 block: [300, 200] -> [3, 2]
        "l.weight": torch.zeros(300, 200).to(torch.float8_e4m3fn),
        "l.weight_scale_inv": torch.ones(3, 2),
        # a scale on another grid: the data is not described alone, the scale stays a plain fp32 tensor
        "bad.weight": torch.zeros(300, 200).to(torch.float8_e4m3fn),
        "bad.weight_scale_inv": torch.ones(2, 2),
        # per-tensor scale -> fp8_e5m2; MX: e8m0 scale per 32 of the last dim -> mxfp8
        "p.weight": torch.zeros(4, 4).to(torch.float8_e5m2), "p.weight_scale": torch.ones(()),
        "m.weight": torch.zeros(4, 64).to(torch.float8_e4m3fn),
        "m.weight_scale": torch.full((4, 2), 127, dtype=torch.uint8).view(torch.float8_e8m0fnu),
        # gpt-oss MXFP4: blocks U8 [E, rows, G, 16] + scales U8 [E, rows, G] -> [E, rows, 32 G]
        "e.gate_up_proj_blocks": torch.zeros(2, 8, 2, 16, dtype=torch.uint8),
        "e.gate_up_proj_scales": torch.zeros(2, 8, 2, dtype=torch.uint8),
        "o.down_blocks": torch.zeros(2, 8, 2, 8, dtype=torch.uint8),   # 16 elements per scale: not mxfp4
        "o.down_scales": torch.zeros(2, 8, 2, dtype=torch.uint8),
    }, str(tmp_path / "q.safetensors"))
    ckpt = describe(tmp_path)
    got = _layout_tensors(loads(ckpt.text))
    assert got == {"l.weight": ("l.weight", (300, 200), "fp8_b128"),
                   "bad.weight_scale_inv": ("bad.weight_scale_inv", (2, 2), "fp32"),
                   "p.weight": ("p.weight", (4, 4), "fp8_e5m2"),
                   "m.weight": ("m.weight", (4, 64), "mxfp8"),
                   "e.gate_up_proj": ("e.gate_up_proj", (2, 8, 64), "mxfp4")}
    by = ckpt.by_name
    assert [e.key for e in by["l.weight"].entries] == ["l.weight", "l.weight_scale_inv"]
    assert [e.key for e in by["e.gate_up_proj"].entries] == ["e.gate_up_proj_blocks", "e.gate_up_proj_scales"]
    assert {s.entry.key for s in ckpt.skipped} == {"bad.weight", "o.down_blocks", "o.down_scales"}
    assert "fits no block-scaled format" in next(s.reason for s in ckpt.skipped if s.entry.key == "bad.weight")


def test_a_deepseek_fp8_checkpoint_plans_into_a_bf16_tp2_layout(tmp_path):
    """A hand-built DeepSeek-V3-style header (no data worth writing): fp8_b128 source, TP2 bf16 destination."""
    entries = [("model.layers.0.mlp.down_proj.weight", "F8_E4M3", [256, 384]),
               ("model.layers.0.mlp.down_proj.weight_scale_inv", "F32", [2, 3])]
    _write(tmp_path / "model.safetensors", _header(entries))
    src = describe(tmp_path).layout
    dst = loads("mesh infer (tp=2)\ntensor model.layers.0.mlp.down_proj.weight [256, 384 over tp]")
    assert src.tensors[0].dtype == "fp8_b128"
    plan = compile_plan(src, dst)
    check_stats(plan, simulate(RunsView(plan.src), RunsView(plan.dst), plan))
    assert plan.unused_keys == []


# ---- a transformers checkpoint is a layout, and plans with `layoutc new` layouts of its config ------------

@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, vocab_size=100, intermediate_size=128)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    folder = tmp_path_factory.mktemp("llama")
    model.save_pretrained(folder, max_shard_size="40KB")
    return folder, {k: (tuple(v.shape), v.dtype) for k, v in model.state_dict().items()}


def test_save_pretrained_shards_describe_every_key(llama_dir):
    folder, state = llama_dir
    truth = _truth(folder)
    assert len({f for _, _, f in truth.values()}) >= 3 and (folder / "model.safetensors.index.json").is_file()
    weight_map = json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"]
    ckpt = describe(folder)
    assert ckpt.index == "model.safetensors.index.json" and len(ckpt.files) == len(set(weight_map.values()))
    got = _layout_tensors(ckpt.layout)
    assert got == {k: (k, shape, LAYOUT_DTYPE[dt]) for k, (dt, shape, _) in truth.items()}
    assert set(got) == set(state) and all(got[k][1] == state[k][0] for k in state)
    assert {t.name: t.data.file for t in ckpt.tensors} == weight_map
    for name in {t.data.file for t in ckpt.tensors}:
        assert f'# file "{name}"' in ckpt.text


@pytest.mark.parametrize("convention,sets", [("vllm", ["--set", "TP=2"]), ("hf", ["--set", "DP=2"]),
                                             ("megatron", ["--set", "TP=2", "--set", "PP=2"])])
def test_the_checkpoint_pairs_with_layoutc_new_layouts_of_its_config(llama_dir, convention, sets, capsys):
    folder, _ = llama_dir
    assert main(["new", "checkpoint", str(folder)]) == 0
    src = loads(capsys.readouterr().out, "ckpt")
    assert main(["new", convention, "--config", str(folder / "config.json"), *sets]) == 0
    dst = loads(capsys.readouterr().out, convention)
    plan = compile_plan(src, dst)
    check_stats(plan, simulate(RunsView(plan.src), RunsView(plan.dst), plan))
    assert plan.unused_keys == []
    back = compile_plan(dst, src)  # and the other way: a save's plan
    check_stats(back, simulate(RunsView(back.src), RunsView(back.dst), back))


def test_config_json_gives_q_and_k_rows_their_rotary_halves(llama_dir, tmp_path, capsys):
    """H 64, 4 heads of D 16, 2 KV heads (the fixture's config): q_proj rows are (4, (re: 8 | im: 8)),
    k_proj rows (2, (re: 8 | im: 8)), v_proj and the rest plain, as `layoutc new hf` writes them.
    The same files without config.json stay plain and pair with `layoutc new hf` all the same
    (the plain rows read as its halves: the same ops); `config=` gives the halves back."""
    folder, _ = llama_dir
    text = describe(folder).text
    assert "# q/k rows as rotary halves, from config.json" in text
    assert "tensor model.layers.0.self_attn.q_proj.weight [(4, (re: 8 | im: 8)), 64]" in text
    assert "tensor model.layers.1.self_attn.k_proj.weight [(2, (re: 8 | im: 8)), 64]" in text
    assert "tensor model.layers.0.self_attn.v_proj.weight [32, 64]" in text
    ir = lambda layout: [(t.name, t.key, t.dtype, t.dims) for t in layout.tensors]  # noqa: E731
    assert ir(loads(text, "ckpt")) == ir(describe(folder).layout)  # the IR built without parsing agrees
    bare = tmp_path / "bare"
    bare.mkdir()
    for f in folder.glob("*.safetensors*"):
        (bare / f.name).write_bytes(f.read_bytes())
    plain = describe(bare)
    assert "rotary" not in plain.text
    assert "tensor model.layers.0.self_attn.q_proj.weight [64, 64]" in plain.text
    assert main(["new", "hf", "--config", str(folder / "config.json")]) == 0
    hf_text = capsys.readouterr().out
    hf = loads(hf_text, "<hf>")
    again = describe(bare, config=folder / "config.json")
    assert again.text.replace(str(bare.name), "") == text.replace(str(folder.name), "")
    plan = compile_plan(again.layout, hf)
    check_stats(plan, simulate(RunsView(plan.src), RunsView(plan.dst), plan))
    # the plain rows are read as the halves they meet (layoutlang/compiler/refine.py): the same ops, both ways
    for a, b in ((plain.layout, hf), (hf, plain.layout)):
        refined = compile_plan(a, b)
        check_stats(refined, simulate(RunsView(refined.src), RunsView(refined.dst), refined))
    assert compile_plan(plain.layout, hf).ops == plan.ops


def test_layoutc_new_checkpoint_output_and_usage(llama_dir, tmp_path, capsys):
    folder, _ = llama_dir
    out = tmp_path / "ckpt.layout"
    assert main(["new", "checkpoint", str(folder), "-o", str(out)]) == 0
    assert "wrote" in capsys.readouterr().out
    assert out.read_text() == describe(folder).text
    assert main(["check", str(out)]) == 0
    assert main(["new", "checkpoint"]) == 2
    assert main(["new", "checkpoint", str(folder), "--config", str(folder / "config.json")]) == 2
    assert main(["new", "vllm", str(folder)]) == 2
    assert main(["new", "vllm"]) == 2
    assert main(["new", "checkpoint", str(tmp_path / "nothing")]) == 2
    err = capsys.readouterr().err
    assert "takes a directory" in err and "takes --config" in err and "nothing" in err


# ---- hostile files: a diagnostic naming the file and the key -----------------------------------------------

def _header(entries, metadata=None) -> bytes:
    """A header JSON from (key, dtype, shape[, (begin, end)]) entries, packed in order unless offsets are given."""
    parts, at = [], 0
    if metadata is not None:
        parts.append(f'"__metadata__": {json.dumps(metadata)}')
    for entry in entries:
        key, dtype, shape = entry[:3]
        n = {"F32": 4, "BF16": 2, "F8_E4M3": 1, "U8": 1}.get(dtype, 1)
        for d in shape:
            n *= d
        begin, end = entry[3] if len(entry) > 3 else (at, at + n)
        at = max(at, end)
        parts.append(f'{json.dumps(key)}: {{"dtype": "{dtype}", "shape": {json.dumps(shape)}, '
                     f'"data_offsets": [{begin}, {end}]}}')
    return ("{" + ", ".join(parts) + "}").encode()


def _write(path, header: bytes, data_len: int | None = None, length: int | None = None) -> None:
    """8-byte length (`length` or the header's), the header, `data_len` zero bytes (default: what it declares)."""
    if data_len is None:
        ends = [e["data_offsets"][1] for k, e in json.loads(header).items() if k != "__metadata__"]
        data_len = max(ends, default=0)
    path.write_bytes(struct.pack("<Q", len(header) if length is None else length) + header + bytes(data_len))


def _error(folder) -> str:
    with pytest.raises(CheckpointError) as info:
        describe(folder)
    return str(info.value)


W = [("w", "F32", [2])]


@pytest.mark.parametrize("case,build,needles", [
    ("truncated_length", lambda p: p.write_bytes(b"\x10\x00\x00"), ["truncated", "8-byte"]),
    ("header_past_file", lambda p: _write(p, _header(W), 0, length=1000), ["truncated", "1000"]),
    ("header_over_cap", lambda p: _write(p, _header(W), 8, length=200_000_000), ["cap", "200000000"]),
    ("not_json", lambda p: _write(p, b"{oops", 0), ["not JSON"]),
    ("not_object", lambda p: _write(p, b"[1, 2]", 0), ["not an object"]),
    ("duplicate", lambda p: _write(p, _header([("w", "F32", [2], (0, 8)), ("w", "F32", [2], (8, 16))]), 16),
     ["`w`", "twice"]),
    ("overlap", lambda p: _write(p, _header([("a", "F32", [2], (0, 8)), ("b", "F32", [2], (4, 12))])),
     ["`b`", "overlaps", "`a`"]),
    ("hole", lambda p: _write(p, _header([("a", "F32", [2], (0, 8)), ("b", "F32", [2], (12, 20))])),
     ["`b`", "hole", "[8, 12)"]),
    ("data_truncated", lambda p: _write(p, _header([("a", "F32", [4])]), 10), ["`a`", "truncated", "past"]),
    ("trailing_bytes", lambda p: _write(p, _header([("a", "F32", [2])]), 12), ["4 bytes", "`a`"]),
    ("wrong_size", lambda p: _write(p, _header([("a", "F32", [3], (0, 8))])), ["`a`", "8 bytes", "12 bytes"]),
    ("unknown_dtype", lambda p: _write(p, _header([("a", "F128", [2], (0, 8))])), ["`a`", "unknown dtype"]),
    ("bad_shape", lambda p: _write(p, _header([("a", "F32", [-1], (0, 0))])), ["`a`", "non-negative"]),
    ("bad_entry", lambda p: _write(p, b'{"a": {"dtype": "F32", "shape": [1]}}', 0), ["`a`", "data_offsets"]),
    ("deep", lambda p: _write(p, b"[" * 100_000 + b"]" * 100_000, 0), ["header"]),
])
def test_hostile_files_get_a_diagnostic_naming_the_file_and_key(tmp_path, case, build, needles):
    build(tmp_path / f"{case}.safetensors")
    message = _error(tmp_path)
    assert f"{case}.safetensors" in message, message
    for needle in needles:
        assert needle in message, message


def _index(folder, weight_map) -> None:
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


def test_an_index_that_disagrees_with_its_files(tmp_path):
    _write(tmp_path / "a.safetensors", _header([("x", "F32", [2]), ("y", "F32", [2])]))
    _write(tmp_path / "b.safetensors", _header([("z", "BF16", [4])]))
    _index(tmp_path, {"x": "a.safetensors", "y": "a.safetensors", "z": "b.safetensors", "gone": "a.safetensors"})
    message = _error(tmp_path)
    assert "a.safetensors" in message and "`gone`" in message and "missing" in message
    _index(tmp_path, {"x": "a.safetensors", "z": "b.safetensors"})
    message = _error(tmp_path)
    assert "a.safetensors" in message and "`y`" in message and "not in model.safetensors.index.json" in message
    _index(tmp_path, {"x": "a.safetensors", "y": "b.safetensors", "z": "b.safetensors"})
    message = _error(tmp_path)
    assert "a.safetensors" in message and "`y`" in message and "b.safetensors" in message
    _index(tmp_path, {"x": "a.safetensors", "y": "a.safetensors", "z": "c.safetensors"})
    message = _error(tmp_path)
    assert "c.safetensors" in message and "`z`" in message
    _index(tmp_path, {"x": "a.safetensors", "y": "a.safetensors", "z": "../b.safetensors"})
    assert "`z`" in _error(tmp_path)
    (tmp_path / "model.safetensors.index.json").write_text('{"weight_map": {"x": "a.safetensors", "x": "b"}}')
    message = _error(tmp_path)
    assert "model.safetensors.index.json" in message and "`x`" in message and "twice" in message
    _index(tmp_path, {"x": "a.safetensors", "y": "a.safetensors", "z": "b.safetensors"})
    assert {t.name: t.data.file for t in describe(tmp_path).tensors} == {
        "x": "a.safetensors", "y": "a.safetensors", "z": "b.safetensors"}


def test_without_an_index_a_key_in_two_files_is_an_error(tmp_path):
    _write(tmp_path / "a.safetensors", _header([("x", "F32", [2])]))
    _write(tmp_path / "b.safetensors", _header([("x", "F32", [2])]))
    message = _error(tmp_path)
    assert "b.safetensors" in message and "a.safetensors" in message and "`x`" in message


def test_the_cli_reports_a_hostile_file_as_a_diagnostic(tmp_path, capsys):
    _write(tmp_path / "m.safetensors", _header([("a", "F32", [2], (0, 8)), ("b", "F32", [2], (4, 12))]))
    assert main(["new", "checkpoint", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: m.safetensors: key `b`: ") and "overlaps" in err
