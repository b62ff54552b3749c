"""Save any layout as an HF checkpoint: every rank writes its own pieces into shared files, no gather.

    >>> from layoutlang.checkpoint import save                          # doctest: +SKIP
    >>> save("out/", "train.layout", my_tensors, group=g, max_shard_size="5GB")  # doctest: +SKIP

1. Every rank computes the same files from the layout alone (`checkpoint_files`):
   the layout's keys in order, cut into files as `save_pretrained` cuts a state
   dict (huggingface_hub's rule: a key that would tip the current file over
   `max_shard_size` starts the next one; a key above it has a file of its own),
   each file's safetensors header with every key's byte range.
2. Rank 0 creates the files under a temporary directory inside the target
   (`.layoutlang-partial-<digest>`): the header, then the file grown to its full
   size (sparse: no data written).
3. The plan from the layout to the files: the files are one extra rank (`mesh
   checkpoint (slot=W)`, every key `at slot=W-1`), so no rank of the layout is
   the receiver and the balanced selector deals the keys' pieces out among their
   holders, as it deals senders in a refit: replicas share the writing, and the
   plan's proof says every byte of every file is written by exactly one rank.
   Each rank writes the pieces it sends straight into the mapped files (a
   quantized checkpoint key is packed on the way, whole scale blocks only).
4. After every rank has written and flushed its pieces (one all-reduce of an ok
   flag), rank 0 moves the files into the target, the index last, and removes
   the temporary directory. A save killed before that leaves only the temporary
   directory: no file of the target looks complete.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
from dataclasses import dataclass
from datetime import timedelta


from ..diagnostics import UsageError
from ..ir import Layout
from ..vocabulary import DTYPE
from .headers import DTYPE_BITS, INDEX_NAME, key_entries, write_header
from .meet import rank_of
from .ranked import FILE, rank_metadata, write_rank

WEIGHTS = "model.safetensors"
PARTIAL = ".layoutlang-partial-"
SIZE_UNITS = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
              "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


def parse_size(size: int | str) -> int:
    """Bytes of `max_shard_size`: an int, or digits and a unit as `save_pretrained` takes ("5GB", "500MiB").

    >>> parse_size("5GB"), parse_size("1.5MiB"), parse_size(4096)
    (5000000000, 1572864, 4096)
    """
    if isinstance(size, int) and not isinstance(size, bool):
        if size < 1:
            raise UsageError(f"max_shard_size {size}: expected a positive number of bytes")
        return size
    m = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]*)?)\s*([A-Za-z]+)\s*", str(size))
    if not m or m.group(2).upper() not in SIZE_UNITS or float(m.group(1)) <= 0:
        raise UsageError(f"max_shard_size {size!r}: expected bytes, or a number and a unit",
                         help=f"units: {', '.join(u if 'I' not in u else u[:-2] + 'iB' for u in SIZE_UNITS)}")
    return max(1, int(float(m.group(1)) * SIZE_UNITS[m.group(2).upper()]))


@dataclass(frozen=True)
class KeyFile:
    """One checkpoint key of the layout and the safetensors entries that hold it (data, then scales)."""

    key: str
    dtype: str                                   # the layout dtype written
    shape: tuple[int, ...]
    entries: tuple[tuple[str, str, tuple[int, ...]], ...]  # (entry key, safetensors dtype, shape)

    @property
    def nbytes(self) -> int:
        return sum(math.prod(s) * DTYPE_BITS[d] // 8 for _, d, s in self.entries)


@dataclass(frozen=True)
class FileLayout:
    """One file to write: its name, header bytes (length prefix included) and size."""

    name: str
    header: bytes
    size: int
    keys: tuple[KeyFile, ...]


def _holds(dtype: str, shape: tuple[int, ...]) -> bool:
    """Whether a key of `shape` can be stored in `dtype` (LANGUAGE.md 4: mxfp8's last dim a multiple
    of 32, fp8_b128's two dims, ...)."""
    d = DTYPE[dtype]
    return len(shape) >= d.min_dims and (not shape or shape[-1] % d.last_dim_multiple == 0)


def layout_keys(layout: Layout, dtype: str | None = None) -> tuple[KeyFile, ...]:
    """Every key of the layout once, in the order it first appears, with its logical shape. With
    `dtype`, every key that can hold it is written in it; one that cannot (a [16] norm in mxfp8,
    whose blocks are 32) keeps its tensor's dtype, as quantized checkpoints keep their norms."""
    seen: dict[str, KeyFile] = {}
    for t in layout.tensors:
        regions = [(t.key, t.logical_shape)] if t.regions is None else [(r.key, r.key_shape) for r in t.regions]
        for key, shape in regions:
            if key not in seen:
                d = dtype if dtype is not None and _holds(dtype, tuple(shape)) else t.dtype
                seen[key] = KeyFile(key, d, tuple(shape), key_entries(key, d, tuple(shape)))
    return tuple(seen.values())


def _header(keys: tuple[KeyFile, ...], metadata: dict[str, str]) -> tuple[bytes, int]:
    """A safetensors header for these keys (as safetensors writes it: `write_header`) and the data size."""
    header, size, _ = write_header([e for k in keys for e in k.entries], metadata)
    return header, size


def checkpoint_files(keys: tuple[KeyFile, ...], max_shard_size: int | str = "5GB",
                     metadata: dict[str, str] | None = None) -> tuple[FileLayout, ...]:
    """The files `save_pretrained` would cut these keys into, each with its header."""
    limit = parse_size(max_shard_size)
    shards: list[list[KeyFile]] = []
    current: list[KeyFile] = []
    size = 0
    for k in keys:
        if k.nbytes > limit:
            shards.append([k])
            continue
        if current and size + k.nbytes > limit:
            shards.append(current)
            current, size = [], 0
        current.append(k)
        size += k.nbytes
    if current:
        shards.append(current)
    meta = {"format": "pt", **(metadata or {})}
    out = []
    for i, shard in enumerate(shards):
        name = WEIGHTS if len(shards) == 1 else f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        header, data = _header(tuple(shard), meta)
        out.append(FileLayout(name, header, len(header) + data, tuple(shard)))
    return tuple(out)


def _index(files: tuple[FileLayout, ...]) -> bytes:
    weight_map = {e[0]: f.name for f in files for k in f.keys for e in k.entries}
    params = sum(math.prod(k.shape) for f in files for k in f.keys)
    total = sum(k.nbytes for f in files for k in f.keys)
    index = {"metadata": {"total_parameters": params, "total_size": total}, "weight_map": weight_map}
    return (json.dumps(index, indent=2, sort_keys=True) + "\n").encode()


def file_plan(src: Layout, ckpt, path: str):
    """The plan of a save: `src` -> the checkpoint's files (`ckpt`, described from their headers)
    as one rank past the source's ranks (the plan of an earlier save of the same digests, if
    one is kept: layouts.py `cached_plan`)."""
    from ..compiler.plan import compile_plan
    from .layouts import cached_plan, plain_layout, text_digest

    text = file_layout_text(src, ckpt.text)

    def build():
        return compile_plan(src, plain_layout(text, path, ("checkpoint", (("slot", src.ranks + 1),)), ckpt.shapes,
                                              {name: src.ranks for name in ckpt.shapes}, rows=ckpt.rows))

    return cached_plan("save", src, text_digest(text), build)


def plan_save(layout: Layout, target: str, *, max_shard_size: int | str = "5GB", dtype: str | None = None,
              metadata: dict[str, str] | None = None, config=None):
    """The plan a save of `layout` into `target` would run, made without touching `target`: the
    files' headers are written (sparse) into a temporary directory, described and planned, then
    removed. A layout that cannot be saved is refused here, at its own line (what `layoutc
    convert` checks before it starts a process)."""
    import tempfile

    from .describe import describe

    files = checkpoint_files(layout_keys(layout, dtype), max_shard_size, metadata)
    with tempfile.TemporaryDirectory(prefix="layoutlang-plan-") as tmp:
        for f in files:
            with open(os.path.join(tmp, f.name), "wb") as fh:
                fh.write(f.header)
                fh.truncate(f.size)
        if len(files) > 1:
            with open(os.path.join(tmp, INDEX_NAME), "wb") as fh:
                fh.write(_index(files))
        ckpt = describe(tmp, config if config is not None else _target_config(target), like=layout)
        plan = file_plan(layout, ckpt, f"<checkpoint {target}>")
        _all_written(plan)
        return plan


def file_layout_text(layout: Layout, ckpt_text: str) -> str:
    """The checkpoint's layout as the plan's destination: one rank past the source's ranks holds it all."""
    slot = layout.ranks
    lines = ckpt_text.splitlines()
    out = []
    for line in lines:
        if line.startswith("mesh "):
            line = f"mesh checkpoint (slot={slot + 1})"
        elif line.startswith("tensor "):
            line = f"{line} at slot={slot}"
        out.append(line)
    return "\n".join(out) + "\n"


@dataclass(frozen=True)
class SaveReport:
    """What one rank's save did: the files, the plan, the bytes this rank wrote, the keys whose
    rows were split over the writers (`exchange`), and how their pieces moved (`transport`:
    "memory", read out of the peers' memory on one host; "links", over the group; "" when
    none was exchanged)."""

    files: tuple[str, ...]
    plan: object
    rank: int
    written_bytes: int
    exchanged: tuple[str, ...] = ()
    transport: str = ""


def save(path: str | os.PathLike, layout, tensors: dict, *, rank: int | None = None, group=None,
         args: dict[str, int] | None = None, max_shard_size: int | str = "5GB", dtype: str | None = None,
         metadata: dict[str, str] | None = None, overwrite: bool = False, per_rank: bool = False, durable: bool = False,
         exchange: bool | None = None, timeout: timedelta | float = timedelta(seconds=300),
         config=None) -> SaveReport:
    """Write every key of `layout` from each rank's `tensors` ({NAME: tensor} as a Refitter's
    sources) into an HF checkpoint at `path` (a directory), in place of nobody's gather.

    Call on every rank of the layout with the same arguments; `group` (or the default group)
    joins them; a one-rank layout needs none. `dtype` casts every key (e.g. "bf16" from fp32
    masters, "mxfp8" to quantize; default: each tensor's own dtype). `metadata` adds to the
    files' `__metadata__` (`format: pt` is always there). The target directory must not hold
    a checkpoint already unless `overwrite`. `timeout`: how long a rank waits for the others
    at each of the save's meetings (a rank that died or stalls makes the others raise `RefitError`).
    `per_rank=True` writes per-rank shard files instead (ranked.py: each rank its own local
    tensors, the layout in `__metadata__`), a fast restart of the same layout and a source for
    any other; `max_shard_size`, `dtype` and `metadata` do not apply to them. `durable=True`:
    rank 0 fsyncs every file (and the directory) before the checkpoint appears, so that it
    survives a power loss too; by default, as `save_pretrained`, the page cache writes it back.
    `exchange` (with a group): None, each plain key that some rank would write as many short
    runs (a column-parallel key: a run per row) is written by rows, each rank a block of them
    that the others send their pieces of (exchange.py); True, every plain key so; False, every
    piece in place. `config`: the model's HF config (a dict or a config.json path; default: the
    target's `config.json`, if it has one) — the files then store q/k rows as the conventions
    describe them, rotary halves and all (describe.py); without one they are plain rows, which
    the plan reads as the halves `layout` writes (layoutlang/compiler/refine.py): the same bytes either way.
    A layout that writes Meta's interleaved pairs (torchtitan's Llama3) needs the config: plain
    rows against those are refused (HF's files hold the halves), before anything is written.
    A save that fails leaves nothing at `path` that was not there before (the directory too,
    when the save created it).
    """
    from ..compiler.plan import as_layout
    from .describe import describe
    from .exchange import exchange_keys
    from .meet import as_timedelta, failures
    from .write import write_pieces

    src = as_layout(layout, args or {})
    if group is None and src.ranks > 1:
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()):
            raise UsageError(f"the layout has {src.ranks} ranks: pass the group that joins them")
        group = dist.group.WORLD
    me = rank_of(rank, group, src.ranks)
    wait = as_timedelta(timeout)

    def _barrier_ok(ok: bool, group, phase: str = "save") -> int:
        return failures(ok, group, me, phase, wait)

    if dtype is not None and dtype not in DTYPE:
        raise UsageError(f"dtype {dtype!r}: expected a layout dtype", help=f"one of {', '.join(DTYPE)}")
    keys = layout_keys(src, dtype)
    if per_rank and (dtype is not None or metadata):
        raise UsageError("per_rank=True writes each rank's tensors as they are stored: no dtype, no metadata")
    files = () if per_rank else checkpoint_files(keys, max_shard_size, metadata)
    names = tuple(FILE.format(rank=r, ranks=src.ranks) for r in range(src.ranks)) if per_rank else \
        tuple(f.name for f in files)
    if per_rank:
        rank_metadata(src, me)  # a layout that cannot be carried is refused on every rank, before anything
    target = os.fspath(path)
    partial = os.path.join(target, PARTIAL + src.digest[:16])
    created = me == 0 and not os.path.lexists(target)  # a failed save removes the directory it made
    ok = False
    try:
        if me == 0:
            _prepare(target, partial, files, overwrite)
        ok = True
    finally:
        if not ok and created:
            _remove_made(target, partial)
        if group is not None and _barrier_ok(ok, group):
            raise UsageError(f"{target}: the save could not start (rank 0 could not create its files)")
    ok, written, plan, exchanged, transport = False, 0, None, [], []
    try:
        if per_rank:
            written = write_rank(os.path.join(partial, names[me]), src, me, tensors)
        else:
            ckpt = describe(partial, config if config is not None else _target_config(target), like=src)
            plan = file_plan(src, ckpt, f"<checkpoint {target}>")
            _all_written(plan)
            exchanged = _exchanged(plan, ckpt, src.ranks, exchange) if group is not None else []
            alongside = None
            if exchanged:  # the exchange's messages fly while this rank writes its own pieces
                def alongside(step):
                    bytes_, how = exchange_keys(src, ckpt, exchanged, me, tensors, group, wait,
                                                f"<checkpoint {target}>", meanwhile=step)
                    transport.append(how)
                    return bytes_
            written = write_pieces(plan, me, ckpt, tensors, group, skip=set(exchanged), alongside=alongside)
        ok = True
    finally:
        failed = _barrier_ok(ok, group) if group is not None else (0 if ok else 1)
        if failed:
            if me == 0:
                shutil.rmtree(partial, ignore_errors=True)
                if created:
                    _remove_made(target, partial)
            if ok:
                from ..runtime.errors import RefitError

                raise RefitError.at(me, 0, "save", f"{failed} rank(s) failed to write their pieces: nothing "
                                    f"was saved to {target}", reusable=False)
    if me == 0:
        _publish(target, partial, names, _index(files) if len(files) > 1 else None, durable)
    if group is not None:
        _barrier_ok(True, group)  # every rank returns once the checkpoint is complete
    return SaveReport(names + ((INDEX_NAME,) if len(files) > 1 else ()), plan, me, written, tuple(exchanged),
                      transport[0] if transport else "")


def _all_written(plan) -> None:
    """Every key of the layout has a place in the files: one the files' description left out
    (entries it cannot pair) would be a key silently never written."""
    if plan.unused_keys:
        key = plan.unused_keys[0]
        raise UsageError(f"key `{key}`: the checkpoint's files cannot hold it as written (describe() leaves "
                         f"it out), so it would not be saved", help="save it in a plain dtype")


def _remove_made(target: str, partial: str) -> None:
    """Undo what a failed save made: its temporary directory, and the target it created, when
    nothing else has appeared there since (a failed save leaves no empty directory behind)."""
    shutil.rmtree(partial, ignore_errors=True)
    try:
        os.rmdir(target)  # only when empty
    except OSError:
        pass


def _target_config(target: str) -> str | None:
    path = os.path.join(target, "config.json")
    return path if os.path.isfile(path) else None


def _exchanged(plan, ckpt, writers: int, exchange: bool | None) -> list[str]:
    """The keys a save exchanges (the same on every rank: the plan's), in the checkpoint's order."""
    from ..ir import QUANTIZED
    from .exchange import short_run_keys

    if exchange is False or writers < 2:
        return []
    return short_run_keys(plan, ckpt) if exchange is None else [t.name for t in ckpt.tensors
                                                                 if t.dtype not in QUANTIZED]


def _prepare(target: str, partial: str, files: tuple[FileLayout, ...], overwrite: bool) -> None:
    os.makedirs(target, exist_ok=True)
    there = [n for n in os.listdir(target) if n.endswith(".safetensors") or n == INDEX_NAME]
    if there and not overwrite:
        raise UsageError(f"{target}: holds a checkpoint already ({there[0]})", help="pass overwrite=True to replace it")
    shutil.rmtree(partial, ignore_errors=True)  # a killed save's leftovers
    os.makedirs(partial)
    for f in files:
        with open(os.path.join(partial, f.name), "wb") as fh:
            fh.write(f.header)
            fh.truncate(f.size)


def _publish(target: str, partial: str, names: tuple[str, ...], index: bytes | None, durable: bool) -> None:
    """Move the written files into the target, the index last; then nothing is left behind."""
    if durable:
        for name in names:
            fd = os.open(os.path.join(partial, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
    for n in os.listdir(target):  # an overwritten checkpoint's files that this one does not have
        if (n.endswith(".safetensors") or n == INDEX_NAME) and n not in names:
            os.unlink(os.path.join(target, n))
    for name in names:
        os.replace(os.path.join(partial, name), os.path.join(target, name))
    if index is not None:
        tmp = os.path.join(partial, INDEX_NAME)
        with open(tmp, "wb") as fh:
            fh.write(index)
        if durable:
            with open(tmp, "rb") as fh:
                os.fsync(fh.fileno())
        os.replace(tmp, os.path.join(target, INDEX_NAME))
    shutil.rmtree(partial, ignore_errors=True)
    if durable:
        fd = os.open(target, os.O_RDONLY)
        try:
            os.fsync(fd)  # the renames
        finally:
            os.close(fd)


__all__ = ["save", "plan_save", "SaveReport", "checkpoint_files", "layout_keys", "parse_size", "KeyFile", "FileLayout"]
