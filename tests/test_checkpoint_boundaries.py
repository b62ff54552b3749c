"""Checkpoint files at their boundaries: a one-byte slip in a header, the order a save writes.

References, independent of layoutlang.checkpoint:
- the safetensors format, written out by hand below (8-byte length, the JSON
  header, data ranges that must tile the data exactly), and the `safetensors`
  package's own reader (`safe_open`), which refuses the same files;
- `safetensors.torch.save_file` of the same tensors: the data order it writes
  (wider dtypes first) and the bytes `safe_open` then reads.

Each slip is ONE byte: an overlap of one byte between two keys' ranges, a one-byte
hole, one byte past the end, one byte after the last key; each at the seam of a
key, both with keys of the same width and with a 4-byte key before a 1-byte one.
"""

from __future__ import annotations

import json
import struct

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from layoutlang import loads
from layoutlang.checkpoint import CheckpointError, checkpoint_files, layout_keys, read_header, save


def _file(path, entries, data_len: int) -> None:
    """A safetensors file by hand: entries (key, dtype, shape, (begin, end)), `data_len` data bytes."""
    head = {k: {"dtype": dt, "shape": shape, "data_offsets": list(offsets)} for k, dt, shape, offsets in entries}
    text = json.dumps(head).encode()
    text += b" " * (-len(text) % 8)
    path.write_bytes(struct.pack("<Q", len(text)) + text + bytes(range(data_len)))


def _reference_refuses(path) -> bool:
    try:
        with safe_open(str(path), "pt") as f:
            for k in f.keys():
                f.get_tensor(k)
    except Exception:  # noqa: BLE001 - the reference's own error types vary by version
        return True
    return False


# (case, entries, data bytes, the message (None: the file is fine))
SLIPS = [
    ("exact", [("a", "U8", [4], (0, 4)), ("b", "U8", [4], (4, 8))], 8, None),
    ("exact_wide_first", [("a", "F32", [2], (0, 8)), ("b", "U8", [5], (8, 13))], 13, None),
    ("overlap_1", [("a", "U8", [4], (0, 4)), ("b", "U8", [4], (3, 7))], 7,
     "key `b`: data [3, 7) overlaps `a`'s, which ends at 4"),
    ("overlap_1_wide", [("a", "F32", [2], (0, 8)), ("b", "U8", [5], (7, 12))], 12,
     "key `b`: data [7, 12) overlaps `a`'s, which ends at 8"),
    ("overlap_1_last_of_three", [("a", "U8", [2], (0, 2)), ("b", "U8", [2], (2, 4)), ("c", "U8", [1], (3, 4))], 4,
     "key `c`: data [3, 4) overlaps `b`'s, which ends at 4"),
    ("overlap_first_byte", [("a", "U8", [4], (0, 4)), ("b", "U8", [1], (0, 1))], 4,
     "key `a`: data [0, 4) overlaps `b`'s, which ends at 1"),  # (sorted by start, then end)
    ("hole_1", [("a", "U8", [4], (0, 4)), ("b", "U8", [4], (5, 9))], 9,
     "key `b`: a hole: no key holds the data bytes [4, 5) before this key's"),
    ("hole_first_byte", [("a", "U8", [4], (1, 5))], 5,
     "key `a`: a hole: no key holds the data bytes [0, 1) before this key's"),
    ("past_end_1", [("a", "U8", [4], (0, 4)), ("b", "U8", [4], (4, 8))], 7,
     "key `b`: truncated: data [4, 8) runs past the end of the data (7 bytes)"),
    ("trailing_1", [("a", "U8", [4], (0, 4)), ("b", "U8", [4], (4, 8))], 9,
     "1 bytes after the last key's data belong to no key (the last is `b`)"),
]


@pytest.mark.parametrize("case,entries,data_len,message", SLIPS, ids=[s[0] for s in SLIPS])
def test_a_one_byte_slip_between_data_ranges_is_refused(tmp_path, case, entries, data_len, message):
    path = tmp_path / f"{case}.safetensors"
    _file(path, entries, data_len)
    assert _reference_refuses(path) == (message is not None)  # the format's own reader agrees
    if message is None:
        got = read_header(path)
        assert [(e.key, e.begin - got.data_start, e.end - got.data_start) for e in got.entries] == \
            [(k, b, e) for k, _, _, (b, e) in entries]
        return
    with pytest.raises(CheckpointError) as info:
        read_header(path)
    assert info.value.message == f"{case}.safetensors: {message}"


# ---- the order a save writes: wider elements first, every offset aligned ------------------------

LAYOUT = "layout mixed\nmesh m (r=1)\ntensor s [1, 32] mxfp8\ntensor f [2, 3] fp32\n"
WIDTH = {"F32": 4, "BF16": 2, "F8_E4M3": 1, "U8": 1}  # bytes per element (the format's dtypes)


def _tensors():
    codes = torch.tensor([(7 * i + 3) % 120 for i in range(32)], dtype=torch.uint8).reshape(1, 32)
    scales = torch.tensor([[121]], dtype=torch.uint8)  # an E8M0 exponent
    return {"s": (codes.view(torch.float8_e4m3fn), scales),
            "f": torch.arange(6, dtype=torch.float32).reshape(2, 3) * 0.5 - 1}


def _raw_header(path):
    raw = path.read_bytes()
    n = struct.unpack("<Q", raw[:8])[0]
    head = json.loads(raw[8:8 + n])
    head.pop("__metadata__", None)
    return 8 + n, {k: (v["dtype"], tuple(v["shape"]), tuple(v["data_offsets"])) for k, v in head.items()}


def _check_order(data_start: int, head: dict) -> None:
    """The rule by hand: ranges tile the data in order, widths never grow, every absolute offset aligned."""
    ranges = sorted((b, e, WIDTH[dt], k) for k, (dt, _, (b, e)) in head.items())
    at = 0
    for b, e, w, k in ranges:
        assert b == at, (k, ranges)
        assert (data_start + b) % w == 0, f"`{k}` at {data_start + b} is not a multiple of {w}"
        at = e
    widths = [w for _, _, w, _ in ranges]
    assert widths == sorted(widths, reverse=True), ranges


def test_save_writes_the_wide_key_first_so_every_offset_is_aligned(tmp_path):
    """A [1, 32] mxfp8 key (32 one-byte codes, 1 one-byte scale) declared before a [2, 3] fp32 one:
    written in declaration order, the fp32 data would start at byte 33 of the data."""
    tensors = _tensors()
    out = tmp_path / "saved"
    save(out, loads(LAYOUT, "mixed.layout"), tensors)
    data_start, head = _raw_header(out / "model.safetensors")
    assert {k: v[:2] for k, v in head.items()} == {"s": ("F8_E4M3", (1, 32)), "s_scale": ("U8", (1, 1)),
                                                   "f": ("F32", (2, 3))}
    _check_order(data_start, head)
    assert head["f"][2] == (0, 24)  # the only 4-byte key: first
    # save_file of the same tensors (the safetensors package's own order) puts every key at the same place
    ref = tmp_path / "ref.safetensors"
    save_file({"s": tensors["s"][0], "s_scale": tensors["s"][1], "f": tensors["f"]}, str(ref))
    assert {k: v[2] for k, v in _raw_header(ref)[1].items()} == {k: v[2] for k, v in head.items()}
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        assert torch.equal(f.get_tensor("s").view(torch.uint8), tensors["s"][0].view(torch.uint8))
        assert torch.equal(f.get_tensor("s_scale"), tensors["s"][1])
        assert torch.equal(f.get_tensor("f"), tensors["f"])


def test_checkpoint_files_order_wide_keys_first_whatever_the_declaration_order():
    for text in (LAYOUT, "layout mixed\nmesh m (r=1)\ntensor f [2, 3] fp32\ntensor s [1, 32] mxfp8\n",
                 "layout m\nmesh m (r=1)\ntensor a [3] fp8_e4m3\ntensor b [5] bf16\ntensor c [1, 32] mxfp8\n"
                 "tensor d [7] fp32\n"):
        (one,) = checkpoint_files(layout_keys(loads(text, "m.layout")))
        n = struct.unpack("<Q", one.header[:8])[0]
        head = json.loads(one.header[8:8 + n])
        assert head.pop("__metadata__") == {"format": "pt"}
        _check_order(8 + n, {k: (v["dtype"], tuple(v["shape"]), tuple(v["data_offsets"])) for k, v in head.items()})
        assert one.size == 8 + n + sum(v["data_offsets"][1] - v["data_offsets"][0] for v in head.values())
