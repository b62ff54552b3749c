"""safetensors headers, read from the format alone: keys, dtypes, shapes and byte ranges, never the data.

The format (huggingface/safetensors, `docs` and `safetensors/src/tensor.rs`)::

    [0, 8)        N: the header's length, an unsigned little-endian 64-bit integer
    [8, 8 + N)    a UTF-8 JSON object {KEY: {"dtype", "shape", "data_offsets": [begin, end]}, ...}
                  with an optional "__metadata__": {str: str}; padded with spaces
    [8 + N, end)  the data: KEY's bytes are [8 + N + begin, 8 + N + end), C order, little-endian

Reading a file costs two `os.pread` calls (8 bytes, then N bytes, N capped at
`MAX_HEADER_BYTES`, the reference reader's own cap), whatever the file's size.
Every check below is one a hostile or damaged file can fail; each failure is a
`CheckpointError` naming the file and, where there is one, the key:

- the file is shorter than 8 bytes, or than 8 + N;
- N is above the cap;
- the header is not UTF-8, not JSON, not an object, or repeats a key;
- an entry is not {"dtype", "shape", "data_offsets"} with a known dtype, a shape of
  non-negative integers and two integer offsets;
- its byte size is not shape x dtype width (whole bytes for sub-byte dtypes);
- the data ranges, sorted, do not tile [0, file size - 8 - N) exactly: an
  overlap, a hole, or a range past the end of the file (truncated data).

`read_checkpoint(dir)` reads every file of a checkpoint directory and checks
`model.safetensors.index.json` against them: a key the index maps to a file that
lacks it, a key of a file that the index does not map there, a file the index
names that is missing, and (without an index) a key held by two files (except in per-rank
shard files, whose keys are each rank's own: ranked.py checks those against their layout).

>>> DTYPE_BITS["BF16"], DTYPE_BITS["F4"], DTYPE_BITS["F6_E2M3"], DTYPE_BITS["F8_E8M0"]
(16, 4, 6, 8)
>>> byte_size("F4", (3, 4)), byte_size("BF16", ())
(6, 2)
"""

from __future__ import annotations

import errno
import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping

from ..diagnostics import LayoutError, UsageError
from ..vocabulary import DTYPE

# Every dtype of the format (safetensors 0.6+ `Dtype`), with its width in bits.
DTYPE_BITS = {
    "BOOL": 8, "U8": 8, "I8": 8, "U16": 16, "I16": 16, "U32": 32, "I32": 32, "U64": 64, "I64": 64,
    "F16": 16, "BF16": 16, "F32": 32, "F64": 64, "C64": 64,
    "F8_E4M3": 8, "F8_E5M2": 8, "F8_E4M3FNUZ": 8, "F8_E5M2FNUZ": 8, "F8_E8M0": 8,
    "F6_E2M3": 6, "F6_E3M2": 6, "F4": 4,
}
# The order safetensors' writer lays entries out in (its `Dtype` enum's order, widest last: a file's
# data holds them from the last of this tuple to the first, by name within one dtype). Read off
# safetensors 0.8's `save_file` for every dtype torch has; the rest placed by width beside them.
SAFETENSORS_ORDER = {name: i for i, name in enumerate((
    "BOOL", "F4", "F6_E2M3", "F6_E3M2", "U8", "I8", "F8_E5M2", "F8_E4M3", "F8_E4M3FNUZ", "F8_E5M2FNUZ", "F8_E8M0",
    "I16", "U16", "F16", "BF16", "I32", "U32", "F32", "C64", "F64", "I64", "U64"))}
MAX_HEADER_BYTES = 100_000_000   # the reference reader's MAX_HEADER_SIZE
MAX_INDEX_BYTES = 100_000_000    # model.safetensors.index.json
INT64_MAX = (1 << 63) - 1
INDEX_NAME = "model.safetensors.index.json"
METADATA = "__metadata__"
ENTRY_FIELDS = ("dtype", "shape", "data_offsets")


class CheckpointError(LayoutError):
    """A checkpoint file is damaged, hostile or inconsistent: the message names the file and the key."""


@dataclass(frozen=True)
class Entry:
    """One key of one safetensors file, as its header says.

    `begin`/`end` are ABSOLUTE byte offsets in the file (the header's
    `data_offsets` plus 8 + N), so a reader can `pread(fd, end - begin, begin)`.
    """

    key: str
    file: str          # the file's name inside the checkpoint directory
    dtype: str         # a safetensors dtype, a key of DTYPE_BITS
    shape: tuple[int, ...]
    begin: int
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.begin


@dataclass(frozen=True)
class FileHeader:
    """One safetensors file's header: its entries in data order, its `__metadata__`."""

    name: str
    path: str
    size: int                          # bytes of the whole file
    data_start: int                    # 8 + N: where the data begins
    entries: tuple[Entry, ...]
    metadata: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class CheckpointFiles:
    """Every file of a checkpoint directory, checked against each other and the index."""

    path: str
    files: tuple[FileHeader, ...]
    index: str | None                  # the index file's name, when there is one
    ignored: tuple[str, ...] = ()      # *.safetensors files the index does not name

    @property
    def entries(self) -> tuple[Entry, ...]:
        return tuple(e for f in self.files for e in f.entries)


def byte_size(dtype: str, shape: tuple[int, ...]) -> int | None:
    """Bytes of a tensor of `dtype` and `shape`, or None when sub-byte elements leave a partial byte."""
    bits = math.prod(shape) * DTYPE_BITS[dtype]
    return bits // 8 if bits % 8 == 0 else None


def _fail(file: str, message: str, key: str | None = None, help: str | None = None) -> CheckpointError:
    where = f"{file}: key `{key}`: " if key is not None else f"{file}: "
    return CheckpointError(where + message, help=help)


def _no_duplicates(file: str):
    def hook(pairs: list[tuple[str, object]]) -> dict:
        out: dict = {}
        for name, value in pairs:
            if name in out:
                raise _fail(file, "appears twice in the header (a JSON object with a repeated name)", name,
                            help="a safetensors header names each key once; rewrite the file")
            out[name] = value
        return out
    return hook


def _pread_exact(fd: int, n: int, offset: int) -> bytes:
    chunks, got = [], 0
    while got < n:
        chunk = os.pread(fd, min(n - got, 1 << 24), offset + got)
        if not chunk:
            break
        chunks.append(chunk)
        got += len(chunk)
    return b"".join(chunks)


def _entry(file: str, key: str, raw: object, data_start: int) -> tuple[Entry, int, int]:
    if not isinstance(raw, dict) or set(raw) != set(ENTRY_FIELDS):
        got = sorted(raw) if isinstance(raw, dict) else type(raw).__name__
        raise _fail(file, f"expected an object with exactly {', '.join(ENTRY_FIELDS)}, got {got}", key)
    dtype, shape, offsets = raw["dtype"], raw["shape"], raw["data_offsets"]
    if dtype not in DTYPE_BITS:
        raise _fail(file, f"unknown dtype {json.dumps(dtype)}", key,
                    help=f"safetensors dtypes: {', '.join(DTYPE_BITS)}")
    if not isinstance(shape, list) or not all(type(d) is int and 0 <= d <= INT64_MAX for d in shape):
        raise _fail(file, f"shape {json.dumps(shape)} is not a list of non-negative integers", key)
    if math.prod(shape) > INT64_MAX:
        raise _fail(file, f"shape {shape} has more than 2^63 - 1 elements", key)
    if (not isinstance(offsets, list) or len(offsets) != 2
            or not all(type(o) is int and 0 <= o <= INT64_MAX for o in offsets) or offsets[0] > offsets[1]):
        raise _fail(file, f"data_offsets {json.dumps(offsets)} are not [begin, end] with 0 <= begin <= end", key)
    begin, end = offsets
    want = byte_size(dtype, tuple(shape))
    if want is None:
        raise _fail(file, f"{dtype} {shape} is not a whole number of bytes", key)
    if end - begin != want:
        raise _fail(file, f"data_offsets [{begin}, {end}] hold {end - begin} bytes, but {dtype} {shape} "
                          f"is {want} bytes", key)
    return Entry(key, file, dtype, tuple(shape), data_start + begin, data_start + end), begin, end


def read_header(path: str | os.PathLike) -> FileHeader:
    """The checked header of one safetensors file (reads 8 + N bytes, never the data)."""
    path = os.fspath(path)
    name = os.path.basename(path)
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError as exc:
        raise UsageError(f"{path}: cannot open: {exc.strerror or exc}") from None
    try:
        size = os.fstat(fd).st_size
        head = _pread_exact(fd, 8, 0)
        if len(head) < 8:
            raise _fail(name, f"truncated: {len(head)} bytes, shorter than the 8-byte header length")
        n = int.from_bytes(head, "little")
        if n > MAX_HEADER_BYTES:
            raise _fail(name, f"header length {n} is above the cap of {MAX_HEADER_BYTES} bytes")
        if 8 + n > size:
            raise _fail(name, f"truncated: the header claims {n} bytes but the file has {size - 8} after "
                              "its length")
        raw = _pread_exact(fd, n, 8)
    finally:
        os.close(fd)
    if len(raw) < n:
        raise _fail(name, f"truncated while reading: {len(raw)} of {n} header bytes")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise _fail(name, f"the header is not UTF-8 (byte {exc.start})") from None
    try:
        header = json.loads(text, object_pairs_hook=_no_duplicates(name))
    except CheckpointError:
        raise
    except RecursionError:
        raise _fail(name, "the header nests too deeply to be a safetensors header") from None
    except ValueError as exc:  # json.JSONDecodeError, and integers too long to convert
        raise _fail(name, f"the header is not JSON: {exc}") from None
    if not isinstance(header, dict):
        raise _fail(name, f"the header is a JSON {type(header).__name__}, not an object")
    metadata = header.pop(METADATA, None) or {}
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise _fail(name, "__metadata__ is not an object of strings", METADATA)
    data_start = 8 + n
    ranges = []
    for key, raw_entry in header.items():
        entry, begin, end = _entry(name, key, raw_entry, data_start)
        ranges.append((begin, end, entry))
    ranges.sort(key=lambda r: (r[0], r[1], r[2].key))
    data_bytes, at, prev = size - data_start, 0, None
    for begin, end, entry in ranges:
        if begin < at:
            raise _fail(name, f"data [{begin}, {end}) overlaps `{prev.key}`'s, which ends at {at}", entry.key)
        if begin > at:
            raise _fail(name, f"a hole: no key holds the data bytes [{at}, {begin}) before this key's", entry.key)
        if end > data_bytes:
            raise _fail(name, f"truncated: data [{begin}, {end}) runs past the end of the data ({data_bytes} "
                              "bytes)", entry.key)
        at, prev = end, entry
    if at != data_bytes:
        raise _fail(name, f"{data_bytes - at} bytes after the last key's data belong to no key" +
                    (f" (the last is `{prev.key}`)" if prev else ""))
    return FileHeader(name, path, size, data_start, tuple(r[2] for r in ranges), dict(metadata))


def _read_index(directory: Path) -> dict[str, str]:
    path = directory / INDEX_NAME
    try:
        with open(path, "rb") as fh:
            raw = fh.read(MAX_INDEX_BYTES + 1)
    except OSError as exc:
        raise UsageError(f"{path}: cannot read: {exc.strerror or exc}") from None
    if len(raw) > MAX_INDEX_BYTES:
        raise _fail(INDEX_NAME, f"larger than the cap of {MAX_INDEX_BYTES} bytes")
    try:
        index = json.loads(raw.decode("utf-8"), object_pairs_hook=_no_duplicates(INDEX_NAME))
    except CheckpointError:
        raise
    except (ValueError, RecursionError) as exc:
        raise _fail(INDEX_NAME, f"not JSON: {exc}") from None
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict):
        raise _fail(INDEX_NAME, "expected a JSON object with a `weight_map` object (key -> file)")
    for key, file in weight_map.items():
        if not isinstance(file, str) or os.path.basename(file) != file or file in ("", ".", ".."):
            raise _fail(INDEX_NAME, f"maps to {json.dumps(file)}, not a file name in the directory", key)
    return weight_map


def _check_link(path: Path) -> None:
    """A symbolic link (an HF cache snapshot is a directory of them, into `../../blobs/`) is
    followed; one that leads nowhere, or back into itself, is an error naming it."""
    if not path.is_symlink():
        return
    try:
        os.stat(path)
    except OSError as exc:
        target = os.readlink(path)
        if exc.errno == errno.ELOOP:
            raise _fail(path.name, f"is a symbolic link that loops ({path.name} -> {target})") from None
        raise _fail(path.name, f"is a symbolic link to {target}, which does not exist"
                    + (f" ({exc.strerror})" if exc.errno != errno.ENOENT and exc.strerror else "")) from None


def read_checkpoint(path: str | os.PathLike) -> CheckpointFiles:
    """Every header of a checkpoint: a directory (with or without an index) or one .safetensors file.
    Symbolic links are followed (HF cache snapshots); a broken or looping one is an error."""
    root = Path(path)
    if root.is_file():
        return CheckpointFiles(str(root), (read_header(root),), None)
    if not root.is_dir():
        raise UsageError(f"{root}: not a directory of safetensors files (nor one file)")
    _check_link(root / INDEX_NAME)
    indexed = (root / INDEX_NAME).is_file()
    listed = sorted(p for p in root.iterdir() if p.name.endswith(".safetensors"))
    if not indexed:
        for p in listed:
            _check_link(p)
    found = [p.name for p in listed if p.is_file()]
    if not indexed:
        if not found:
            raise UsageError(f"{root}: no *.safetensors file and no {INDEX_NAME}")
        files = tuple(read_header(root / name) for name in found)
        if all("layoutlang.layout" in f.metadata for f in files):
            return CheckpointFiles(str(root), files, None)  # per-rank shard files: ranked.py checks them
        seen: dict[str, str] = {}
        for f in files:
            for e in f.entries:
                if e.key in seen:
                    raise _fail(f.name, f"is also in {seen[e.key]} (a key is held by one file; an index "
                                        "would say which)", e.key)
                seen[e.key] = f.name
        return CheckpointFiles(str(root), files, None)
    weight_map = _read_index(root)
    names = sorted(set(weight_map.values()))
    for name in names:
        _check_link(root / name)
        if not (root / name).is_file():
            key = next(k for k, v in weight_map.items() if v == name)
            raise _fail(INDEX_NAME, f"maps to {name}, which is not in {root}", key)
    files = tuple(read_header(root / name) for name in names)
    for f in files:
        have = {e.key for e in f.entries}
        for e in f.entries:
            if e.key not in weight_map:
                raise _fail(f.name, f"is not in {INDEX_NAME}", e.key,
                            help="the index must map every key of every file")
            if weight_map[e.key] != f.name:
                raise _fail(f.name, f"is mapped to {weight_map[e.key]} by {INDEX_NAME}", e.key)
        for key, name in weight_map.items():
            if name == f.name and key not in have:
                raise _fail(f.name, f"is missing: {INDEX_NAME} maps it to this file", key)
    ignored = tuple(n for n in found if n not in set(names))
    return CheckpointFiles(str(root), files, INDEX_NAME, ignored)



def write_header(entries, metadata: dict[str, str]) -> tuple[bytes, int, dict[str, int]]:
    """A safetensors file's first bytes for `entries` ((name, safetensors dtype, shape), names
    unique), laid out as safetensors' own writer lays them out (`save_file`, so `save_pretrained`):
    by dtype, widest first (`SAFETENSORS_ORDER`), then by name, listed in that order after
    `__metadata__`, compact JSON padded with spaces to 8 bytes. Returns the bytes (length prefix
    and header), the data's size and each entry's data offset from the data's start. Files
    written from the same tensors are then byte for byte the ones `save_pretrained` writes."""
    head: dict[str, object] = {"__metadata__": metadata}
    at, offsets = 0, {}
    for name, st, shape in sorted(entries, key=lambda e: (-SAFETENSORS_ORDER[e[1]], e[0])):
        n = math.prod(shape) * DTYPE_BITS[st] // 8
        head[name] = {"dtype": st, "shape": list(shape), "data_offsets": [at, at + n]}
        offsets[name] = at
        at += n
    text = json.dumps(head, separators=(",", ":"), ensure_ascii=False).encode()
    text += b" " * (-len(text) % 8)
    return len(text).to_bytes(8, "little") + text, at, offsets


ST_PLAIN = {"bf16": "BF16", "fp16": "F16", "fp32": "F32"}  # a plain layout dtype -> its safetensors dtype


def key_entries(key: str, dtype: str, shape: tuple[int, ...]) -> tuple[tuple[str, str, tuple[int, ...]], ...]:
    """The entries a key of `dtype` is stored as (name, safetensors dtype, shape): describe's pairing rules,
    read backwards; what a save and per-rank shard files write."""
    if dtype in ST_PLAIN:
        return ((key, ST_PLAIN[dtype], shape),)
    grid = DTYPE[dtype].scales[0].shape(shape) if DTYPE[dtype].scales else ()
    if dtype == "fp8_b128":
        return ((key, "F8_E4M3", shape), (key + "_scale_inv", "F32", grid))
    if dtype == "mxfp8":
        return ((key, "F8_E4M3", shape), (key + "_scale", "U8", grid))
    if dtype in ("fp8_e4m3", "fp8_e5m2"):
        return ((key, "F8_E4M3" if dtype == "fp8_e4m3" else "F8_E5M2", shape), (key + "_scale", "F32", ()))
    if dtype == "mxfp4":
        data = DTYPE[dtype].data_shape(shape)
        return ((key + "_blocks", "U8", (*data[:-1], data[-1] // 16, 16)), (key + "_scales", "U8", grid))
    raise UsageError(f"key `{key}`: {dtype} has no checkpoint format here (bf16, fp16, fp32, fp8_e4m3, "
                     "fp8_e5m2, fp8_b128, mxfp8, mxfp4)")


__all__ = ["DTYPE_BITS", "SAFETENSORS_ORDER", "write_header", "MAX_HEADER_BYTES", "INDEX_NAME", "CheckpointError", "Entry", "FileHeader",
           "CheckpointFiles", "byte_size", "read_header", "read_checkpoint", "ST_PLAIN", "key_entries"]
