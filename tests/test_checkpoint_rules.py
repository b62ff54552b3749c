"""The rules a save follows and the read-once load (layoutlang.checkpoint; docs/checkpoints.md).

References, independent of layoutlang.checkpoint:
- huggingface_hub's own `split_torch_state_dict_into_shards` and `parse_size_to_int`
  (what `save_pretrained` uses) on a state dict of the same sizes in the same order;
- `safe_open` reading what a save wrote; the pairing table of docs/checkpoints.md;
- slices of the reference tensors worked out by hand from the layout text (LANGUAGE.md 3).
"""

import json
import math
import os

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors import safe_open
from safetensors.torch import save_file

from layoutlang import loads
from layoutlang.checkpoint import CheckpointError, checkpoint_files, describe, layout_keys, load, parse_size, save
from layoutlang.diagnostics import UsageError
from layoutlang.runtime.launch import launch

HERE = os.path.dirname(os.path.abspath(__file__))


@settings(max_examples=40, deadline=None)
@given(sizes=st.lists(st.integers(1, 300), min_size=1, max_size=12), limit=st.integers(1, 700))
def test_files_are_cut_as_huggingface_hub_cuts_a_state_dict(sizes, limit):
    from huggingface_hub import split_torch_state_dict_into_shards

    # one fp32 vector per key: its bytes are 4 x its length on both sides
    text = "mesh m (one=1)\n" + "".join(f"tensor k{i} [{n}] fp32\n" for i, n in enumerate(sizes))
    files = checkpoint_files(layout_keys(loads(text)), limit)
    state = {f"k{i}": torch.zeros(n, dtype=torch.float32) for i, n in enumerate(sizes)}
    hub = split_torch_state_dict_into_shards(state, max_shard_size=limit)
    assert {f.name: [k.key for k in f.keys] for f in files} == {n: list(ks) for n, ks in hub.filename_to_tensors.items()}


@pytest.mark.parametrize("text", ["5GB", "7MB", "1.5KB", "12TB", " 3 GB "])
def test_sizes_read_as_huggingface_hub_reads_them(text):
    from huggingface_hub.serialization._base import parse_size_to_int

    assert parse_size(text) == parse_size_to_int(text)


def test_binary_units_and_bad_sizes():
    assert parse_size("2MiB") == 2 * 1024 * 1024
    for bad in ("5 parsecs", "-1GB", 0, "GB"):
        with pytest.raises(UsageError, match="max_shard_size"):
            parse_size(bad)


def test_every_dtype_is_written_as_describe_pairs_it(tmp_path):
    # one rank, one key per dtype; the file's keys and dtypes are the pairing table read backwards
    text = """mesh m (one=1)
tensor a [4, 64] bf16
tensor b [4, 64] fp32
tensor c [130, 256] fp8_b128
tensor d [4, 64] mxfp8
tensor e [4, 64] fp8_e4m3
tensor f [4, 64] mxfp4
"""
    from layoutlang.runtime.quant import quantize

    torch.manual_seed(0)
    ref = {"a": torch.randn(4, 64), "b": torch.randn(4, 64), "c": torch.randn(130, 256), "d": torch.randn(4, 64),
           "e": torch.randn(4, 64), "f": torch.randn(4, 64)}
    dtypes = dict(a="bf16", b="fp32", c="fp8_b128", d="mxfp8", e="fp8_e4m3", f="mxfp4")
    tensors = {k: (v.to({"bf16": torch.bfloat16, "fp32": torch.float32}[dtypes[k]]) if dtypes[k] in ("bf16", "fp32")
                   else quantize(v.bfloat16(), dtypes[k])) for k, v in ref.items()}
    save(tmp_path, loads(text), tensors)
    with safe_open(tmp_path / "model.safetensors", "pt") as fh:
        got = {k: (fh.get_slice(k).get_dtype(), fh.get_slice(k).get_shape()) for k in fh.keys()}
        assert torch.equal(fh.get_tensor("c").view(torch.uint8), tensors["c"].data.view(torch.uint8))
        assert torch.equal(fh.get_tensor("c_scale_inv"), tensors["c"].scales)
        assert torch.equal(fh.get_tensor("f_blocks").reshape(4, 32), tensors["f"].data.view(torch.uint8))
        assert fh.metadata() == {"format": "pt"}
    assert got == {"a": ("BF16", [4, 64]), "b": ("F32", [4, 64]), "c": ("F8_E4M3", [130, 256]),
                   "c_scale_inv": ("F32", [2, 2]), "d": ("F8_E4M3", [4, 64]), "d_scale": ("U8", [4, 2]),
                   "e": ("F8_E4M3", [4, 64]), "e_scale": ("F32", []), "f_blocks": ("U8", [4, 2, 16]),
                   "f_scales": ("U8", [4, 2])}
    assert {t.name: t.dtype for t in describe(tmp_path).tensors} == dtypes
    assert not [n for n in os.listdir(tmp_path) if n.startswith(".layoutlang-partial")]


def test_a_checkpoint_already_there_is_kept_unless_overwrite(tmp_path):
    layout = loads("mesh m (one=1)\ntensor w [4] fp32\n")
    save(tmp_path, layout, {"w": torch.ones(4)})
    with pytest.raises(UsageError, match="holds a checkpoint already") as e:
        save(tmp_path, layout, {"w": torch.zeros(4)})
    assert "overwrite=True" in e.value.help
    save(tmp_path, layout, {"w": torch.full((4,), 2.0)}, overwrite=True, durable=True)
    with safe_open(tmp_path / "model.safetensors", "pt") as fh:
        assert fh.get_tensor("w").tolist() == [2.0] * 4


# 2 ranks, TP2: q|k|v packed per rank, an embedding padded from 10 to 12 rows and split
TP_LAYOUT = """mesh m (tp=2)
tensor qkv [(q: 8 as q.weight | k: 4 as k.weight | v: 4 as v.weight) over tp, 6]
tensor emb.weight [10 pad 4 over tp, 6]
tensor norm.weight [6] fp32
"""


def _reference():
    g = torch.Generator().manual_seed(7)
    return {"q.weight": torch.randn(8, 6, generator=g).bfloat16(), "k.weight": torch.randn(4, 6, generator=g).bfloat16(),
            "v.weight": torch.randn(4, 6, generator=g).bfloat16(), "emb.weight": torch.randn(10, 6, generator=g).bfloat16(),
            "norm.weight": torch.randn(6, generator=g)}


def _expected(r: dict, rank: int) -> dict:
    """Worked out from TP_LAYOUT by hand: each part split in halves; 10 rows padded to 12, 6 per rank."""
    emb = torch.zeros(12, 6, dtype=torch.bfloat16)
    emb[:10] = r["emb.weight"]
    return {"qkv": torch.cat([r["q.weight"][4 * rank:4 * rank + 4], r["k.weight"][2 * rank:2 * rank + 2],
                              r["v.weight"][2 * rank:2 * rank + 2]]),
            "emb.weight": emb[6 * rank:6 * rank + 6], "norm.weight": r["norm.weight"]}


def test_each_rank_loads_its_own_slices_in_one_process(tmp_path):
    ref = _reference()
    save_file(ref, tmp_path / "model.safetensors")
    layout = loads(TP_LAYOUT)
    for rank in range(2):
        tensors = {k: torch.full_like(v, float("nan")) for k, v in _expected(ref, rank).items()}
        report = load(tmp_path, layout, tensors, rank=rank)
        assert all(torch.equal(tensors[k], v) for k, v in _expected(ref, rank).items())
        assert all(op.local for op in report.plan.ops)
        # bytes copied out of the files: this rank's q, k, v, emb rows (bf16) and the whole norm (fp32)
        assert report.read_bytes == (4 + 2 + 2) * 6 * 2 + (6 if rank == 0 else 4) * 6 * 2 + 6 * 4


CP_LAYOUT = "mesh m (tp=2)\ntensor wide [64, 256 over tp] bf16\ntensor odd [5, 256 over tp] fp32\n"
CP_KEYS = {"wide": ((64, 256), torch.bfloat16), "odd": ((5, 256), torch.float32)}


def test_the_read_once_load_and_a_save_on_two_processes(tmp_path):
    ref = _reference()
    src = tmp_path / "src"
    src.mkdir()
    save_file({k: v for k, v in ref.items() if k != "emb.weight"}, src / "a.safetensors")
    save_file({"emb.weight": ref["emb.weight"]}, src / "b.safetensors")
    job = {"src": str(src), "out": str(tmp_path / "out"), "layout": TP_LAYOUT, "big_out": str(tmp_path / "big"),
           "stall_out": str(tmp_path / "stall"), "ranked_out": str(tmp_path / "ranked"),
           "big_layout": "mesh m (tp=2)\ntensor cols [4, 65536 over tp] fp32\ntensor rows [256 over tp, 512] fp32\n",
           "cp_out": str(tmp_path / "cp"), "cp_layout": CP_LAYOUT}
    results = launch(job, 2, program=os.path.join(HERE, "checkpoint_rules_program.py"), timeout=120)
    assert all(r.ok for r in results), [(r.error, (r.result or {}).get("trace")) for r in results]
    for r in results:
        rank = r.rank
        for mode in ("local", "exchange"):
            got = {k: torch.tensor(v) for k, v in r.result[mode].items()}
            want = _expected(ref, rank)
            assert all(torch.equal(got[k], want[k].float()) for k in want), (mode, rank)
        # read once: each key was read by exactly one of the two ranks
    read = [r.result["exchange_read"] for r in results]
    assert sum(read) == sum(v.numel() * v.element_size() for v in ref.values())
    index = json.loads((tmp_path / "out" / "model.safetensors.index.json").read_text()) \
        if (tmp_path / "out" / "model.safetensors.index.json").exists() else None
    assert index is None  # 4 keys of 280 bytes: one file under the default 5GB
    with safe_open(tmp_path / "out" / "model.safetensors", "pt") as fh:
        assert sorted(fh.keys()) == sorted(ref)
        assert all(torch.equal(fh.get_tensor(k), v) for k, v in ref.items())
    assert sum(r.result["written"] for r in results) == sum(v.numel() * v.element_size() for v in ref.values())
    # the long runs (pwrite): every element where the layout says, as the program filled them
    with safe_open(tmp_path / "big" / "model.safetensors", "pt") as fh:
        assert torch.equal(fh.get_tensor("cols"), torch.arange(4 * 65536, dtype=torch.float32).reshape(4, 65536))
        assert torch.equal(fh.get_tensor("rows"), -torch.arange(256 * 512, dtype=torch.float32).reshape(256, 512))
    # column-parallel keys (a short run per row): exchanged, rows split over the 2 writers as
    # torch.chunk cuts them (wide 32 + 32, odd 3 + 2); every element where the full tensor has it
    assert [sorted(r.result["cp_exchanged"]) for r in results] == [["odd", "wide"]] * 2
    for out in ("cp", "cp_links", "cp_strided", "cp_refused"):
        with safe_open(tmp_path / out / "model.safetensors", "pt") as fh:
            for name, (shape, dtype) in CP_KEYS.items():
                assert torch.equal(fh.get_tensor(name), torch.arange(math.prod(shape)).reshape(shape).to(dtype)), \
                    (out, name)
    # the pieces moved out of the peers' memory where this machine lets a process read its
    # siblings' (checked here without the project), else over the links; forced, strided
    # sources and one rank that cannot read: the links on every rank
    memory = "memory" if _sibling_memory_readable() else "links"
    assert [r.result["cp_transport"] for r in results] == [memory] * 2
    for what in ("cp_links_transport", "cp_strided_transport", "cp_refused_transport"):
        assert [r.result[what] for r in results] == ["links"] * 2, what
    # rank 1 stalled 4 s before its save: rank 0 gave up after its 1 s timeout, not the group's 120 s
    stall = results[0].result
    assert "did not meet within 1 s" in stall["stall"] and stall["stall_s"] < 4.0, stall
    assert not [n for n in os.listdir(tmp_path / "stall") if n.endswith(".safetensors")]
    _check_per_rank_files(tmp_path / "ranked", ref)


def _sibling_memory_readable() -> bool:
    """Whether process_vm_readv(2) reads a forked child's memory here (ptrace policy, seccomp)."""
    import ctypes

    class Iovec(ctypes.Structure):
        _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]

    libc = ctypes.CDLL(None, use_errno=True)
    secret = ctypes.create_string_buffer(b"a sibling's bytes", 17)
    got = ctypes.create_string_buffer(17)
    go, done = os.pipe()
    child = os.fork()
    if child == 0:
        os.read(go, 1)
        os._exit(0)
    try:
        local, remote = Iovec(ctypes.addressof(got), 17), Iovec(ctypes.addressof(secret), 17)
        n = libc.process_vm_readv(child, ctypes.byref(local), 1, ctypes.byref(remote), 1, 0)
        return n == 17 and got.raw == b"a sibling's bytes"
    finally:
        os.write(done, b"x")
        os.waitpid(child, 0)


def _check_per_rank_files(ranked, ref):
    """Per-rank shard files: rank r's local tensors by NAME with the layout in the metadata; a
    source for the same layout (each rank its own file) and for any other."""
    assert sorted(os.listdir(ranked)) == ["rank-00000-of-00002.safetensors", "rank-00001-of-00002.safetensors"]
    for rank in range(2):
        with safe_open(ranked / f"rank-{rank:05d}-of-00002.safetensors", "pt") as fh:
            assert fh.metadata()["layoutlang.layout"] == TP_LAYOUT and fh.metadata()["layoutlang.rank"] == str(rank)
            assert all(torch.equal(fh.get_tensor(k), v) for k, v in _expected(ref, rank).items())
    ckpt = describe(ranked)
    assert ckpt.per_rank and TP_LAYOUT in ckpt.text and ckpt.layout.ranks == 2
    layout = loads(TP_LAYOUT)
    for rank in range(2):  # the same layout again: each rank reads its own file
        tensors = {k: torch.full_like(v, float("nan")) for k, v in _expected(ref, rank).items()}
        report = load(ranked, layout, tensors, rank=rank)
        assert all(torch.equal(tensors[k], v) for k, v in _expected(ref, rank).items())
        assert {op.src_rank for op in report.plan.ops_for_rank(rank) if op.dst_rank == rank} == {rank}
    # another layout: one rank, every key whole and apart, an fp32 copy of the bf16 keys
    whole = loads("mesh m (one=1)\n" + "".join(f"tensor {k} [{', '.join(map(str, v.shape))}] fp32\n"
                                                for k, v in ref.items()))
    tensors = {k: torch.full(v.shape, float("nan")) for k, v in ref.items()}
    load(ranked, whole, tensors, rank=0)
    assert all(torch.equal(tensors[k], v.float()) for k, v in ref.items())
    os.unlink(ranked / "rank-00001-of-00002.safetensors")
    with pytest.raises(CheckpointError, match="shard file of rank 1 .of 2. is missing"):
        describe(ranked)


def test_a_source_in_the_destination_s_format_is_forwarded_not_requantized(tmp_path):
    """LANGUAGE.md 4.1: a source stored in the same format with the same block grid is forwarded.
    Codes whose block amax is not 448 x scale (any checkpoint not quantized by this project's rule)
    would come out different, and lossy, through bf16 and a new scale."""
    from layoutlang.runtime.loopback import refit
    from layoutlang.runtime.quant import Fp8BlockTensor, empty

    g = torch.Generator().manual_seed(3)
    codes = (torch.randn(256, 128, generator=g) * 3).to(torch.float8_e4m3fn)
    scales = torch.rand(2, 1, generator=g) + 0.5
    save_file({"w": codes, "w_scale_inv": scales}, tmp_path / "model.safetensors")
    layout = loads("mesh m (tp=2)\ntensor w [256 over tp, 128] fp8_b128\n")
    for rank in range(2):
        t = {"w": empty("fp8_b128", (128, 128))}
        load(tmp_path, layout, t, rank=rank)
        assert torch.equal(t["w"].data.view(torch.uint8), codes[128 * rank:128 * rank + 128].view(torch.uint8))
        assert torch.equal(t["w"].scales, scales[rank:rank + 1])
    # a refit between two layouts of the same format: TP2 rows -> TP2 columns (whole 128-blocks)
    src = loads("mesh m (tp=2)\ntensor w [256 over tp, 256] fp8_b128\n")
    dst = loads("mesh m (tp=2)\ntensor w [256, 256 over tp] fp8_b128\n")
    from layoutlang import compile_plan

    big = (torch.randn(256, 256, generator=g) * 3).to(torch.float8_e4m3fn)
    grid = torch.rand(2, 2, generator=g) + 0.5
    given = {r: {"w": Fp8BlockTensor(big[128 * r:128 * r + 128].clone(), grid[r:r + 1].clone())} for r in range(2)}
    out = {r: {"w": empty("fp8_b128", (256, 128))} for r in range(2)}
    refit(compile_plan(src, dst), given, out)
    for r in range(2):
        assert torch.equal(out[r]["w"].data.view(torch.uint8), big[:, 128 * r:128 * r + 128].view(torch.uint8))
        assert torch.equal(out[r]["w"].scales, grid[:, r:r + 1])


def test_blocks_cut_by_the_destination_are_quantized_once_from_the_values(tmp_path):
    # rows split at 64: no fp8_b128 block of the source is whole on a rank, so each rank
    # assembles its values (code x scale) and quantizes them once: amax / 448 per block
    from reference_quant import quantize_fp8_b128 as reference
    from layoutlang.runtime.quant import empty

    g = torch.Generator().manual_seed(4)
    codes = (torch.randn(128, 128, generator=g) * 3).to(torch.float8_e4m3fn)
    scales = torch.tensor([[0.75]])
    save_file({"w": codes, "w_scale_inv": scales}, tmp_path / "model.safetensors")
    values = (codes.float() * 0.75).bfloat16()
    layout = loads("mesh m (tp=2)\ntensor w [128 over tp, 128] fp8_b128\n")
    for rank in range(2):
        t = {"w": empty("fp8_b128", (64, 128))}
        load(tmp_path, layout, t, rank=rank)
        want = reference(values[64 * rank:64 * rank + 64].float().tolist())
        assert torch.equal(t["w"].data.view(torch.uint8), torch.tensor(want.codes, dtype=torch.uint8))
        assert torch.equal(t["w"].scales, torch.tensor(want.scales, dtype=torch.float32))


def _ir(layout):
    """Everything a Layout says, spans as positions (the parsed and the built one hold different
    Source objects of the same text)."""
    pos = lambda s: (s.line, s.col, s.end_line, s.end_col)  # noqa: E731
    return (layout.path, layout.name, layout.args, layout.digest, layout.sources[0].text,
            [(m.name, m.axes, m.offset, pos(m.span)) for m in layout.meshes],
            [(type(t), t.key, t.name, t.dtype, t.mesh.name, t.fixed, t.logical_shape, t.local_shape,
              [(d.mode, d.over, d.chunk) for d in t.dims], pos(t.span)) for t in layout.tensors])


def test_checkpoint_layouts_are_built_as_their_text_elaborates(tmp_path):
    """layouts.py skips the parser: its IR must be what `loads` makes of the same text."""
    from layoutlang.checkpoint.load import reader_layout, reader_text

    save_file({"a.w": torch.zeros(3, 4, dtype=torch.bfloat16), "b": torch.zeros(5), "c": torch.zeros(()),
               "d-x/y": torch.zeros(2, dtype=torch.float16), "ids": torch.zeros(3, dtype=torch.int64),
               "x.weight": torch.zeros(256, 130, dtype=torch.float8_e4m3fn), "x.weight_scale_inv": torch.zeros(2, 2)},
              tmp_path / "model.safetensors")
    save_file({"e": torch.zeros(7, 2, 3, dtype=torch.bfloat16)}, tmp_path / "more.safetensors")
    ckpt = describe(tmp_path)
    where = f"<checkpoint {ckpt.path}>"
    assert _ir(ckpt.layout) == _ir(loads(ckpt.text, where))
    for readers, exchange in ((1, False), (3, False), (3, True)):
        text = reader_text(ckpt, readers, exchange=exchange)
        assert _ir(reader_layout(ckpt, readers, exchange=exchange)) == _ir(loads(text, where))
    # dealt largest first to the reader with the fewest bytes (ties: lowest), by hand: x.weight
    # (33296 B) -> 0, e (84) -> 1, a.w (24) -> 2, b (20) -> 2, c (4) -> 2, d_x_y (4) -> 2
    assert {t.name: t.fixed for t in reader_layout(ckpt, 3, exchange=True).tensors} == \
        {"x.weight": ((0, 0),), "e": ((0, 1),), "a.w": ((0, 2),), "b": ((0, 2),), "d_x_y": ((0, 2),), "c": ((0, 2),)}


def test_a_save_exchanges_the_keys_whose_pieces_are_short_runs_and_splits_their_rows(tmp_path):
    from layoutlang.checkpoint.exchange import RUN_BYTES, rounds, rows_of, short_run_keys
    from layoutlang.checkpoint.save import file_plan

    # by hand (LANGUAGE.md 3, row-major files): a column block of `wide` is 64 runs of 64 bf16
    # (128 B), of `narrow` 32 runs; a row block of `rows` is one run; `long` is 4 runs of
    # 65536 bf16 (128 KiB, above RUN_BYTES)
    assert 65536 * 2 >= RUN_BYTES > 128
    text = ("mesh m (tp=4)\ntensor wide [64, 256 over tp] bf16\ntensor narrow [32, 256 over tp] bf16\n"
            "tensor rows [256 over tp, 64] bf16\ntensor long [4, 262144 over tp] bf16\ntensor odd [5, 256 over tp] bf16\n")
    one = text.replace("mesh m (tp=4)", "mesh m (one=1)").replace(" over tp", "")
    src = loads(text)
    shapes = {"wide": (64, 256), "narrow": (32, 256), "rows": (256, 64), "long": (4, 262144), "odd": (5, 256)}
    save(tmp_path, loads(one), {k: torch.zeros(s, dtype=torch.bfloat16) for k, s in shapes.items()})
    ckpt = describe(tmp_path)
    plan = file_plan(src, ckpt, "<files>")
    keys = short_run_keys(plan, ckpt)
    assert sorted(keys) == ["narrow", "odd", "wide"]
    # rows over 4 writers as torch.chunk cuts them: 64 -> 16 each; 5 -> 2, 2, 1, 0
    assert [rows_of(ckpt.by_name["wide"], w, 4) for w in range(4)] == [(0, 16), (16, 32), (32, 48), (48, 64)]
    assert [rows_of(ckpt.by_name["odd"], w, 4) for w in range(4)] == [(0, 2), (2, 4), (4, 5), (5, 5)]
    # rounds bound what a writer assembles: writer 0's rows of wide are 16 x 512 B = 8192 B, of
    # narrow 8 x 512 = 4096 B; a key whose block alone is above the cap has a round of its own
    assert rounds(ckpt, ["wide", "narrow"], 4, 10000) == [["wide"], ["narrow"]]
    assert rounds(ckpt, ["wide", "narrow"], 4, 12288) == [["wide", "narrow"]]
    assert rounds(ckpt, ["wide", "narrow"], 4, 1) == [["wide"], ["narrow"]]
    # the writers' layout is what its text elaborates to (built from one statement per shape)
    from layoutlang.checkpoint.exchange import writer_layout

    built = writer_layout(ckpt, ["wide", "odd", "narrow"], 4, "<writers>")
    text = ("layout writers\nmesh checkpoint (writer=4)\ntensor wide [64 over writer ragged, 256] bf16\n"
            "tensor odd [5 over writer ragged, 256] bf16\ntensor narrow [32 over writer ragged, 256] bf16\n")
    parsed = loads(text, "<writers>")
    assert built.digest == parsed.digest
    strip = lambda ir: (ir[0], [t[:-1] for t in ir[1]])  # noqa: E731 - spans: the prototypes' lines
    assert strip(_ir(built)) == strip(_ir(parsed))


def test_a_repeated_save_reuses_its_plan_and_writes_the_same_bytes(tmp_path):
    """A plan is a pure function of its layouts' digests (DESIGN.md: equal digests, equal
    layouts): a save of the same layout and files to another directory reuses the first
    save's plan (layouts.py `cached_plan`) and writes the same files; another layout plans anew."""
    one = loads("mesh m (one=1)\ntensor a [4, 8] fp32\ntensor b [3] fp32\n")
    tensors = {"a": torch.arange(32, dtype=torch.float32).reshape(4, 8), "b": torch.tensor([1.0, 2.0, 3.0])}
    first = save(tmp_path / "first", one, tensors)
    again = save(tmp_path / "again", one, tensors)
    assert again.plan is first.plan
    written = [(tmp_path / d / "model.safetensors").read_bytes() for d in ("first", "again")]
    assert written[0] == written[1]
    other = loads("mesh m (one=1)\ntensor a [4, 8] bf16\ntensor b [3] fp32\n")
    third = save(tmp_path / "other", other, {"a": tensors["a"].to(torch.bfloat16), "b": tensors["b"]})
    assert third.plan is not first.plan and third.plan.digest != first.plan.digest
    with safe_open(tmp_path / "other" / "model.safetensors", "pt") as fh:
        assert fh.get_tensor("a").dtype == torch.bfloat16 and torch.equal(fh.get_tensor("a").float(), tensors["a"])
