"""A checkpoint describes itself: a directory of safetensors files -> its `.layout`, from headers only.

The layout has one rank (`mesh checkpoint (one=1)`) holding every key whole, as
its own tensor: NAME = KEY = the checkpoint's key, the header's shape, the
layout dtype of the header's dtype. So any layout whose keys are HF checkpoint
names (every `layoutc new` convention, every shipped example) plans against it:

    >>> import json, os, tempfile
    >>> d = tempfile.mkdtemp()
    >>> head = json.dumps({"w": {"dtype": "BF16", "shape": [2, 3], "data_offsets": [0, 12]}}).encode()
    >>> with open(os.path.join(d, "model.safetensors"), "wb") as fh:
    ...     _ = fh.write(len(head).to_bytes(8, "little") + head + bytes(12))
    >>> ckpt = describe(d)
    >>> [line for line in ckpt.text.splitlines() if line.startswith(("mesh", "tensor"))]
    ['mesh checkpoint (one=1)', 'tensor w [2, 3]']
    >>> ckpt.tensors[0].data.file, ckpt.tensors[0].data.begin, ckpt.layout.tensors[0].local_shape
    ('model.safetensors', 74, (2, 3))

Rules (docs/checkpoints.md has the tables):
- dtypes: BF16 / F16 / F32 -> bf16 / fp16 / fp32; F8_E4M3 / F8_E5M2 without a
  scale tensor -> fp8_e4m3 / fp8_e5m2 with an implied scale of 1.
- scale tensors pair with their data as one block-scaled tensor, when the
  vocabulary's scale grid (layoutlang/vocabulary.py) gives exactly their shape:
  `X` F8_E4M3 + `X_scale_inv` or `X_scale` F32 on the 128 x 128 grid -> fp8_b128
  (DeepSeek-V3); + `X_scale` F32 of shape [] or [1] -> fp8_e4m3 / fp8_e5m2;
  + `X_scale` U8 / F8_E8M0 on the 32-element grid -> mxfp8; `X_blocks` U8
  [..., G, 16] + `X_scales` U8 / F8_E8M0 [..., G] -> `X` [..., 32 G] mxfp4 (gpt-oss).
  A scale-named tensor that fits no grid stays apart, and its data is skipped
  (its values are not the stored numbers alone).
- a key the language cannot hold is SKIPPED, with the reason, in the text (a
  comment) and in `Checkpoint.skipped`: integer and bool tensors, F64, C64, the
  FNUZ fp8s, lone F8_E8M0 / F4 / F6 tensors, tensors with a 0 extent.
- rotary rows: with the model's config (a `config.json` beside the files, or
  `config=`) of a family `layoutc new` knows, `model.layers.N.self_attn.q_proj` /
  `k_proj` weights and biases write their rows as every convention does,
  `(heads, (re: D/2 | im: D/2))` (each head's rotate_half halves: HF's storage
  order, named so that a Meta-order source pairs with it, LANGUAGE.md 3); without
  a config they stay plain, and pair only with layouts that write them plain.
- a key that is not a layout name (segments of letters, digits and `_` joined by
  dots) is renamed: every other character becomes `_` (an empty segment `_`),
  with `_2`, `_3`... against clashes; `Stored.data.key` keeps the checkpoint's.
"""

from __future__ import annotations

import json
import os
import re
from collections import Counter
from dataclasses import dataclass
from functools import cached_property
from typing import Mapping

from ..vocabulary import DTYPE, DTYPES
from .headers import CheckpointFiles, Entry, FileHeader, read_checkpoint

PLAIN = {"BF16": "bf16", "F16": "fp16", "F32": "fp32"}
FP8 = {"F8_E4M3": "fp8_e4m3", "F8_E5M2": "fp8_e5m2"}
E8M0_CODES = ("U8", "F8_E8M0")        # how checkpoints store E8M0 scales
SCALE_SUFFIXES = ("_scale_inv", "_scale")
MESH = "checkpoint (one=1)"
_NAME = re.compile(r"[A-Za-z0-9_]+(?:\.[A-Za-z0-9_]+)*")
_LACKS = {"BOOL": "bool", "U8": "integer", "I8": "integer", "U16": "integer", "I16": "integer", "U32": "integer",
          "I32": "integer", "U64": "integer", "I64": "integer", "F64": "fp64", "C64": "complex",
          "F8_E4M3FNUZ": "fp8 e4m3fnuz", "F8_E5M2FNUZ": "fp8 e5m2fnuz", "F8_E8M0": "standalone e8m0",
          "F4": "standalone e2m1 (fp4)", "F6_E2M3": "fp6", "F6_E3M2": "fp6"}


@dataclass(frozen=True)
class Stored:
    """One tensor of the checkpoint's layout and the checkpoint entries that hold it.

    `name` is its NAME and KEY in the layout (the checkpoint key, unless renamed
    or a block-scaled pair: gpt-oss's `X_blocks` + `X_scales` is `X`); `shape`
    its logical shape; `data` the entry of its elements; `scales` one entry per
    scale grid of `DTYPE[dtype]`, in that order (empty for plain dtypes and for
    fp8 with an implied scale of 1).
    """

    name: str
    dtype: str
    shape: tuple[int, ...]
    data: Entry
    scales: tuple[Entry, ...] = ()
    rows: tuple[int, int] | None = None  # dim 0 is (heads, (re: half | im: half)): (heads, half)

    @property
    def entries(self) -> tuple[Entry, ...]:
        return (self.data, *self.scales)


@dataclass(frozen=True)
class Skipped:
    """A checkpoint key the layout leaves out, and why."""

    entry: Entry
    reason: str


@dataclass(frozen=True)
class Checkpoint:
    """What `describe` found: the files, the layout's tensors, the skipped keys, the text.

    `text` is the `.layout` (what `layoutc new checkpoint DIR` prints);
    `layout` the loaded Layout of it (elaborated once, on first use).
    """

    path: str
    files: tuple[FileHeader, ...]
    index: str | None
    tensors: tuple[Stored, ...]
    skipped: tuple[Skipped, ...]
    ignored: tuple[str, ...]
    text: str
    # per-rank shard files (ranked.py): `text` is the saved layout's, loaded with `args`;
    # `tensors` is empty (rank r's tensors are file r's, by NAME)
    per_rank: bool = False
    args: tuple[tuple[str, int], ...] = ()
    rotary: str | None = None  # where the rotary rows came from (a config.json), None: none written

    @cached_property
    def layout(self):
        if self.per_rank:
            from ..elaborate import loads

            return loads(self.text, f"<checkpoint {self.path}>", dict(self.args) or None)
        from .layouts import plain_layout  # the IR `loads(self.text)` gives, without parsing

        return plain_layout(self.text, f"<checkpoint {self.path}>", ("checkpoint", (("one", 1),)), self.shapes,
                            rows=self.rows)

    @cached_property
    def shapes(self) -> Mapping[str, tuple[str, tuple[int, ...]]]:
        """(layout dtype, logical shape) of each tensor by NAME."""
        return {t.name: (t.dtype, t.shape) for t in self.tensors}

    @cached_property
    def rows(self) -> Mapping[str, tuple[int, int]]:
        """(heads, half) of each tensor whose dim 0 is rotary rows, by NAME."""
        return {t.name: t.rows for t in self.tensors if t.rows is not None}

    @cached_property
    def by_name(self) -> Mapping[str, Stored]:
        """The layout's tensors by NAME (= KEY)."""
        return {t.name: t for t in self.tensors}


def _grid(dtype: str, shape: tuple[int, ...], which: int = 0) -> tuple[int, ...] | None:
    """The shape of `dtype`'s scale grid `which` for a tensor of `shape`, None when `shape` cannot hold it."""
    d = DTYPE[dtype]
    if len(shape) < d.min_dims or (shape and shape[-1] % d.last_dim_multiple):
        return None
    return d.scales[which].shape(shape)


def _fp8_pair(data: Entry, scale: Entry) -> str | None:
    """The layout dtype of fp8 `data` with `scale`, or None when no format's grid is the scale's shape."""
    if scale.dtype == "F32" and data.dtype == "F8_E4M3" and _grid("fp8_b128", data.shape) == scale.shape:
        return "fp8_b128"
    if scale.dtype == "F32" and scale.shape in ((), (1,)):
        return FP8[data.dtype]
    if scale.dtype in E8M0_CODES and data.dtype == "F8_E4M3" and _grid("mxfp8", data.shape) == scale.shape:
        return "mxfp8"
    return None


def _mxfp4_shape(blocks: Entry, scales: Entry) -> tuple[int, ...] | None:
    """gpt-oss: `X_blocks` U8 [..., G, 16] and `X_scales` [..., G] are mxfp4 [..., 32 G], if the grid agrees."""
    if blocks.dtype != "U8" or scales.dtype not in E8M0_CODES or len(blocks.shape) < 2:
        return None
    *lead, groups, per = blocks.shape
    logical = (*lead, groups * per * DTYPE["mxfp4"].per_byte)
    if DTYPE["mxfp4"].data_shape(logical)[-1] != groups * per or _grid("mxfp4", logical) != scales.shape:
        return None
    return logical


def _spell(key: str, taken: set[str], keys: Mapping[str, object]) -> str:
    """`key` if it is a layout name, else a layout name made from it: not in `taken`, nor another of `keys`."""
    if _NAME.fullmatch(key) and key not in taken:
        return key
    base = ".".join(re.sub(r"[^A-Za-z0-9_]", "_", seg) or "_" for seg in key.split("."))
    name, n = base, 1
    while name in taken or (name in keys and name != key):
        n += 1
        name = f"{base}_{n}"
    return name


def _q(key: str) -> str:
    return json.dumps(key)  # ASCII, escaped: safe inside a one-line comment


def _pairs(entries: Mapping[str, Entry]) -> tuple[dict[str, tuple[str, tuple[int, ...], tuple[Entry, ...]]],
                                                   dict[str, str]]:
    """{data key: (dtype, logical shape, scale entries)} and {key: reason skipped} from the scale rules."""
    paired, skipped = {}, {}
    for key, e in entries.items():
        if e.dtype in FP8:
            scales = [entries[key + s] for s in SCALE_SUFFIXES if key + s in entries]
            for scale in scales:
                dtype = _fp8_pair(e, scale)
                if dtype is not None:
                    paired[key] = (dtype, e.shape, (scale,))
                    break
            else:
                if scales:
                    skipped[key] = (f"its scale {_q(scales[0].key)} ({scales[0].dtype} {list(scales[0].shape)}) "
                                    "fits no block-scaled format's grid (fp8_b128, fp8_e4m3/e5m2, mxfp8)")
        elif key.endswith("_blocks") and key[:-len("_blocks")] + "_scales" in entries:
            stem = key[:-len("_blocks")]
            scale = entries[stem + "_scales"]
            logical = _mxfp4_shape(e, scale)
            if logical is not None and stem not in entries:
                paired[key] = ("mxfp4", logical, (scale,))
            else:
                reason = (f"the key {_q(stem)} exists too" if logical is not None else
                          f"with {_q(scale.key)} ({scale.dtype} {list(scale.shape)}) it is not mxfp4 storage "
                          "(U8 [..., G, 16] and E8M0 [..., G])")
                skipped[key] = f"not paired as mxfp4: {reason}"
    return paired, skipped


def _config(path: str, config) -> tuple[Mapping | None, str | None]:
    """(the config dict, where it came from): `config` (a dict or a path), else `config.json`
    beside the checkpoint's files, else (None, None). A file that is not JSON is a CheckpointError."""
    if isinstance(config, Mapping):
        return config, "config="
    if config is None:
        folder = path if os.path.isdir(path) else os.path.dirname(os.path.abspath(path))
        config = os.path.join(folder, "config.json")
        if not os.path.isfile(config):
            return None, None
    from .headers import CheckpointError

    try:
        with open(config, encoding="utf-8") as fh:
            data = json.load(fh)
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{os.fspath(config)}: not a readable JSON config: {e}") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{os.fspath(config)}: a config is a JSON object")
    return data, os.path.basename(os.fspath(config))


def _rotary(config: Mapping | None, source: str | None) -> tuple[dict[str, tuple[int, int]], str | None]:
    """{"q": (Q, D), "k": (KV, D)} from the config (bridges/model.py: rotary_heads), or {} with the reason
    none is written (None when there is no config)."""
    if config is None:
        return {}, None
    from ..bridges.model import ConfigError, model_from_config, rotary_heads

    try:
        heads = rotary_heads(model_from_config(config, source=source or "config"))
    except ConfigError as e:
        return {}, f"q/k rows plain: {e.message}"
    return heads, (f"q/k rows as rotary halves, from {source}" if heads else "q/k rows plain: no rotary halves "
                   f"for {config.get('model_type')}'s attention")


def flat_rotary(layout) -> dict[str, tuple[int, int]]:
    """{"q": (Q, D), "k": (KV, D)} as the flat keys of `layout` (ZeRO-3 / FSDP1 shards) write their
    q/k rows: dim 0 `(heads, (re: D/2 | im: D/2))`, two equal halves per head; {} where no flat key
    writes them so, or two disagree."""
    from ..bridges.model import ROTARY_KEY
    from ..modes import ConcatM, FlatM, PadM, PlainM, ProductM

    heads: dict[str, set] = {}
    for t in layout.tensors:
        for dim in t.dims:
            flat = dim.mode.inner if isinstance(dim.mode, PadM) else dim.mode
            if not isinstance(flat, FlatM) or t.regions is None or len(t.regions) != len(flat.keys):
                continue
            for region, key in zip(t.regions, flat.keys):
                m = ROTARY_KEY.fullmatch(region.key)
                rows = key.dims[0] if m and key.dims else None
                if not isinstance(rows, ProductM) or not isinstance(rows.inner, ConcatM):
                    continue
                halves = [p.mode for p in rows.inner.parts]
                if len(halves) == 2 and all(isinstance(h, PlainM) for h in halves) and \
                        halves[0].extent == halves[1].extent:
                    heads.setdefault(m.group(1), set()).add((rows.count, 2 * halves[0].extent))
    if any(len(v) != 1 for v in heads.values()):
        return {}
    return {g: next(iter(v)) for g, v in heads.items()}


def _rows(key: str, shape: tuple[int, ...], heads: Mapping[str, tuple[int, int]]) -> tuple[int, int] | None:
    from ..bridges.model import ROTARY_KEY

    m = ROTARY_KEY.fullmatch(key) if heads else None
    if m is None or not shape:
        return None
    n, d = heads[m.group(1)]
    return (n, d // 2) if shape[0] == n * d else None


def _describe(files: CheckpointFiles, heads: Mapping[str, tuple[int, int]] | None = None
              ) -> tuple[tuple[Stored, ...], tuple[Skipped, ...]]:
    entries = {e.key: e for e in files.entries}
    paired, skipped = _pairs(entries)
    consumed = {s.key for _, _, scales in paired.values() for s in scales}
    taken: set[str] = set()
    stored, left_out = [], []
    for key, e in entries.items():
        if key in consumed:
            continue
        if key in skipped:
            left_out.append(Skipped(e, skipped[key]))
            continue
        if key in paired:
            dtype, shape, scales = paired[key]
            want = key[:-len("_blocks")] if dtype == "mxfp4" else key
        elif e.dtype in PLAIN or e.dtype in FP8:
            dtype, shape, scales, want = (PLAIN.get(e.dtype) or FP8[e.dtype]), e.shape, (), key
        else:
            left_out.append(Skipped(e, f"{e.dtype}: the layout language has no {_LACKS[e.dtype]} dtype"))
            continue
        if 0 in shape:
            left_out.append(Skipped(e, f"an empty tensor {list(shape)}: layout extents are at least 1"))
            continue
        name = _spell(want, taken, entries)
        taken.add(name)
        stored.append(Stored(name, dtype, shape, e, scales, _rows(key, shape, heads or {})))
    return tuple(stored), tuple(left_out)


def _default_dtype(stored: tuple[Stored, ...]) -> str:
    counts = Counter(t.dtype for t in stored)
    return max(DTYPES, key=lambda d: (counts[d], d == "bf16")) if counts else "bf16"


def _n(count: int, noun: str) -> str:
    return f"{count} {noun}{'' if count == 1 else 's'}"


def _dims(t: Stored) -> str:
    dims = [str(d) for d in t.shape]
    if t.rows is not None:
        n, half = t.rows
        dims[0] = f"({n}, (re: {half} | im: {half}))"
    return ", ".join(dims)


def _text(files: CheckpointFiles, stored: tuple[Stored, ...], skipped: tuple[Skipped, ...],
          rotary: str | None = None) -> str:
    default = _default_dtype(stored)
    where = f" (index {files.index})" if files.index else ""
    lines = [f"# The checkpoint {_q(os.path.basename(os.path.abspath(files.path)))}, described from its "
             "safetensors headers",
             f"# ({_n(len(files.files), 'file')}{where}, {_n(len(stored), 'tensor')}, "
             f"{_n(len(skipped), 'key')} skipped):",
             "# one rank holds every key whole; NAME = KEY = the checkpoint's key. A `# file` line",
             "# says which file the tensors after it live in.",
             *([f"# {rotary}"] if rotary else []),
             "layout checkpoint", "", f"mesh {MESH}"]
    if default != "bf16":
        lines.append(f"default dtype {default}")
    for name in files.ignored:
        lines.append(f"# not read: {_q(name)} is not named by {files.index}")
    by_file: dict[str, list] = {f.name: [] for f in files.files}
    for t in stored:
        by_file[t.data.file].append(t)
    for s in skipped:
        by_file[s.entry.file].append(s)
    order = {e.key: i for i, e in enumerate(files.entries)}
    for file, items in by_file.items():
        lines += ["", f"# file {_q(file)}"]
        for item in sorted(items, key=lambda x: order[(x.data if isinstance(x, Stored) else x.entry).key]):
            if isinstance(item, Skipped):
                e = item.entry
                lines.append(f"# skipped {_q(e.key)} {e.dtype} {list(e.shape)}: {item.reason}")
                continue
            for s in item.scales:
                lines.append(f"# {_q(item.data.key)} {item.data.dtype} + {_q(s.key)} {s.dtype} {list(s.shape)}"
                             f" in {_q(s.file)}: {item.dtype}")
            if item.name not in (item.data.key, item.data.key.removesuffix("_blocks")):
                lines.append(f"# renamed from {_q(item.data.key)} (not a layout name)")
            dtype = "" if item.dtype == default else f" {item.dtype}"
            lines.append(f"tensor {item.name} [{_dims(item)}]{dtype}")
    return "\n".join(lines) + "\n"


def describe(path: str | os.PathLike, config=None, *, like=None) -> Checkpoint:
    """The checkpoint at `path` (a directory of safetensors files, or one file), from its headers only.

    `config`: the model's HF config (a dict or a config.json path); default: `config.json`
    beside the files, if there is one. It only gives q/k rows their rotary halves. `like`: the
    Layout a save or load pairs the files with: where no config says, the rotary halves its
    flat keys write (`flat_rotary`: a flat dim's keys pair strictly, docs/language.md 14.9,
    where any other side's plain rows are read as the halves they meet)."""
    files = read_checkpoint(path)
    from .ranked import is_ranked, ranked_source

    if is_ranked(files):
        layout, _ = ranked_source(files)
        head = (f"# Per-rank shard files of {layout.ranks} rank(s) in {_q(os.path.basename(os.path.abspath(files.path)))}: "
                f"rank r's tensors are file r's, by NAME; the layout they were saved from"
                + (f", with {', '.join(f'{k}={v}' for k, v in layout.args)}" if layout.args else "") + ":\n")
        return Checkpoint(files.path, files.files, None, (), (), files.ignored, head + layout.source_text,
                          per_rank=True, args=tuple(layout.args))
    heads, rotary = _rotary(*_config(files.path, config))
    if rotary is None and like is not None:
        heads = flat_rotary(like)
        rotary = "q/k rows as rotary halves, as the layout's flat keys write them" if heads else None
    stored, skipped = _describe(files, heads)
    return Checkpoint(files.path, files.files, files.index, stored, skipped, files.ignored,
                      _text(files, stored, skipped, rotary), rotary=rotary)


def describe_layout(path: str | os.PathLike, config=None):
    """`describe(path, config).layout`: the checkpoint's loaded Layout (what `compile_plan` takes as a side)."""
    return describe(path, config).layout


__all__ = ["Checkpoint", "Stored", "Skipped", "describe", "describe_layout"]
