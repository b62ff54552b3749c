"""Rewrite a checkpoint in another layout or format: load it into a layout's shards, save them.

    >>> from layoutlang.checkpoint.convert import convert         # doctest: +SKIP
    >>> convert("DeepSeek-V3/", "out/", dtype="bf16")             # doctest: +SKIP
    >>> convert("Llama-3-8B/", "mx/", "infer_mxfp8.layout", nproc=2)  # doctest: +SKIP

`layoutc convert SRC -o OUT --to LAYOUT --nproc N` (docs/cli.md). One process per
rank of LAYOUT (`--nproc 1`: this process), joined by gloo on 127.0.0.1 at a
free port (layoutlang/runtime/launch.py starts them, this file is the program each runs).
Each rank allocates the tensors of LAYOUT it holds (local shapes and dtypes;
quantized ones as layoutlang/runtime/quant.py stores them), fills them with `load(SRC,
LAYOUT, ...)` (its own pieces, out of mapped files: a quantized destination is
assembled in bf16 and quantized once, a quantized checkpoint dequantized), then
writes them with `save(OUT, LAYOUT, ..., dtype=...)` (each byte by one rank).
So the conversion is what a load and a save do: `--to` a bf16 layout of an fp8
checkpoint's keys (or `--dtype bf16`) dequantizes it; `--to` an mxfp8 layout
whose shards hold whole 32-element blocks quantizes a bf16 one.

Peak memory per rank: its shards of LAYOUT (plus the staging of a quantized
one). Weights only: `config.json` and the tokenizer are not copied (an fp8
checkpoint's `quantization_config` would be wrong for the bf16 one).
"""

from __future__ import annotations

import os
import sys

if __name__ == "__main__" and sys.path and os.path.abspath(sys.path[0]) == os.path.dirname(os.path.abspath(__file__)):
    # Run as a script by launch(program=...): this folder (load.py, save.py, files.py, ...) must
    # not shadow top-level modules; the package's copy of this module does the work.
    sys.path.pop(0)

import json
import time
import traceback
from dataclasses import dataclass, field
from datetime import timedelta

from layoutlang.diagnostics import LayoutError, UsageError

DEFAULT_TIMEOUT = 600.0  # seconds: the whole conversion, and how long a rank waits for its peers


@dataclass(frozen=True)
class RankResult:
    """What one rank did: bytes copied out of SRC, bytes written into OUT, seconds; or its error."""

    rank: int
    ok: bool
    read_bytes: int = 0
    written_bytes: int = 0
    seconds: float = 0.0
    files: tuple[str, ...] = ()
    error: str | None = None     # what went wrong (a diagnostic's message), None when ok
    help: str | None = None
    usage: bool = False          # the error is a UsageError (bad arguments: exit 2 in the CLI)
    rendered: str | None = None  # the rank's diagnostic as it renders (file:line, caret, notes, help)


@dataclass(frozen=True)
class ConvertReport:
    """A finished conversion: the files written in OUT (index included), their bytes, the time."""

    out: str
    files: tuple[str, ...]
    bytes: int                   # the files' sizes on disk (headers included)
    seconds: float               # wall time, process start-up included
    nproc: int
    ranks: tuple[RankResult, ...] = field(repr=False)
    unused_keys: tuple[str, ...] = ()   # keys of SRC that LAYOUT lacks: not written
    skipped: tuple[str, ...] = ()       # keys of SRC the layout language cannot hold: not written


class ConvertError(LayoutError):
    """Some rank failed; `ranks` says which and why. Nothing was published in OUT."""

    def __init__(self, message: str, ranks: tuple[RankResult, ...], *, help: str | None = None,
                 rendered: str | None = None):
        super().__init__(message, help=help)
        self.ranks = ranks
        self.rendered = rendered  # a rank's own diagnostic, positioned where it was raised

    def render(self) -> str:
        return self.rendered or super().render()


def allocate(layout, rank: int) -> dict:
    """{NAME: tensor} of every tensor of `layout` that `rank` holds, in its local shape and dtype
    (plain ones zeroed; quantized ones as layoutlang/runtime/quant.py stores them, uninitialized)."""
    import torch

    from layoutlang.ir import QUANTIZED
    from layoutlang.runtime import quant

    out = {}
    for t in layout.tensors:
        if not t.holds(rank):
            continue
        shape = tuple(t.local_shape_at(rank))
        out[t.name] = (quant.empty(t.dtype, shape) if t.dtype in QUANTIZED
                       else torch.zeros(shape, dtype=quant.PLAIN_DTYPES[t.dtype]))
    return out


PLAIN = ("bf16", "fp16", "fp32")


def own_layout(ckpt, dtype: str | None = None):
    """The checkpoint's own layout (one rank, every key whole); with a plain `dtype`, every
    tensor in it, so that a quantized key is dequantized once, by the load, straight into
    `dtype` (not loaded in its format, re-quantized, and dequantized by the save)."""
    if dtype not in PLAIN:
        return ckpt.layout
    from layoutlang.elaborate import loads

    lines = ["layout checkpoint", "", "mesh checkpoint (one=1)", f"default dtype {dtype}", ""]
    lines += [f"tensor {t.name} [{', '.join(str(d) for d in t.shape)}]" for t in ckpt.tensors]
    return loads("\n".join(lines) + "\n", f"<checkpoint {ckpt.path} as {dtype}>")


def _layout(src: str, layout, args: dict[str, int] | None, dtype: str | None = None):
    """LAYOUT loaded (a path with its args, or a Layout); None is the checkpoint's own layout
    (in `dtype` when that is a plain dtype: own_layout)."""
    from layoutlang.elaborate import load as load_layout
    from layoutlang.ir import Layout

    from .describe import describe

    if layout is None:
        if args:
            raise UsageError(f"--set {next(iter(args))}: the checkpoint's own layout has no args",
                             help="pass --to LAYOUT to set its args")
        return own_layout(describe(src), dtype)
    if isinstance(layout, Layout):
        return layout
    return load_layout(os.fspath(layout), args or {})


def convert_rank(src: str, out: str, layout, *, rank: int, group=None, args: dict[str, int] | None = None,
                 max_shard_size: int | str = "5GB", dtype: str | None = None,
                 overwrite: bool = False, timeout: float = DEFAULT_TIMEOUT) -> RankResult:
    """One rank's conversion: allocate its tensors of `layout`, load them from `src`, save them to `out`.
    `timeout` (seconds): how long the rank waits for the others at the load's and the save's meetings
    (a big shard may take a while to read)."""
    from .load import load
    from .save import save

    start = time.perf_counter()
    layout = _layout(src, layout, args, dtype)
    tensors = allocate(layout, rank)
    loaded = load(src, layout, tensors, rank=rank, group=group, timeout=timeout)
    saved = save(out, layout, tensors, rank=rank, group=group, max_shard_size=max_shard_size, dtype=dtype,
                 overwrite=overwrite, timeout=timeout)
    return RankResult(rank, True, loaded.read_bytes, saved.written_bytes, time.perf_counter() - start,
                      tuple(saved.files))


def _same_place(a: str, b: str) -> bool:
    try:
        return os.path.samefile(a, b)
    except OSError:
        return os.path.abspath(a) == os.path.abspath(b)


def preflight(src: str, out: str, layout=None, *, args: dict[str, int] | None = None,
              max_shard_size: int | str = "5GB", dtype: str | None = None, overwrite: bool = False):
    """Everything a conversion can refuse before a process starts: SRC (headers), LAYOUT, the load's
    plan (a key LAYOUT needs that SRC lacks is a diagnostic at LAYOUT's line), `dtype`,
    `max_shard_size`, OUT, and the save's plan (save.plan_save: a key LAYOUT cannot write, at its
    line). Returns (checkpoint, layout, load plan, the files OUT will hold)."""
    from layoutlang.vocabulary import DTYPE

    from .describe import describe
    from .headers import INDEX_NAME
    from .load import plan_load
    from .save import checkpoint_files, layout_keys, plan_save

    if dtype is not None and dtype not in DTYPE:
        from layoutlang.diagnostics import did_you_mean

        raise UsageError(f"--dtype {dtype}: not a layout dtype", help=did_you_mean(dtype, DTYPE)
                         or f"one of {', '.join(DTYPE)}")
    ckpt = describe(src)
    target = _layout(src, layout, args, dtype)
    files = checkpoint_files(layout_keys(target, dtype), max_shard_size)  # nvfp4, a bad size: refused here
    if _same_place(src, out) or (os.path.isfile(src) and _same_place(os.path.dirname(os.path.abspath(src)), out)):
        raise UsageError(f"-o {out}: is where the checkpoint {src} is", help="write the conversion to another directory")
    if os.path.exists(out) and not os.path.isdir(out):
        raise UsageError(f"-o {out}: exists and is not a directory")
    if os.path.isdir(out) and not overwrite:
        there = sorted(n for n in os.listdir(out) if n.endswith(".safetensors") or n == INDEX_NAME)
        if there:
            raise UsageError(f"-o {out}: holds a checkpoint already ({there[0]})",
                             help="pass --overwrite to replace it")
    _, plan = plan_load(ckpt, target)
    plan_save(target, out, max_shard_size=max_shard_size, dtype=dtype)  # refused at LAYOUT's line, here
    return ckpt, target, plan, files


def convert(src: str | os.PathLike, out: str | os.PathLike, layout=None, *, args: dict[str, int] | None = None,
            nproc: int | None = None, max_shard_size: int | str = "5GB", dtype: str | None = None,
            overwrite: bool = False, timeout: float = DEFAULT_TIMEOUT, max_nproc: int | None = None,
            checked=None) -> ConvertReport:
    """Rewrite the checkpoint at `src` into `out` in `layout` (a path with `args`; None: the
    checkpoint's own layout, one rank) on `nproc` local processes, one per rank of the layout
    (default: that many; 1 runs here). `dtype` casts every key on the way out (save(dtype=)).
    `timeout` (seconds) bounds the whole job: a rank still running then is killed.
    `checked`: preflight()'s result, when the caller has it already."""
    from layoutlang.runtime.launch import launch

    src, out = os.fspath(src), os.fspath(out)
    ckpt, target, plan, _ = checked or preflight(src, out, layout, args=args, max_shard_size=max_shard_size,
                                                 dtype=dtype, overwrite=overwrite)
    nproc = check_nproc(target, nproc, max_nproc)
    if nproc > 1 and layout is not None and not isinstance(layout, (str, os.PathLike)):
        raise UsageError("a conversion on several processes takes the layout as a path (each process loads it)")
    start = time.perf_counter()
    created = not os.path.exists(out)  # a failed conversion leaves no empty OUT behind
    try:
        if nproc == 1:
            results = (convert_rank(src, out, target, rank=0, max_shard_size=max_shard_size, dtype=dtype,
                                    overwrite=overwrite, timeout=timeout),)
        else:
            job = {"src": os.path.abspath(src), "out": os.path.abspath(out),
                   "layout": None if layout is None else os.path.abspath(os.fspath(layout)), "args": args or {},
                   "max_shard_size": max_shard_size, "dtype": dtype, "overwrite": overwrite, "timeout": timeout}
            results = tuple(_result(w, timeout) for w in launch(job, nproc, timeout=timeout + 30,
                                                                program=os.path.abspath(__file__)))
        failed = tuple(r for r in results if not r.ok)
        if failed:
            raise _failure(failed, results)
    except BaseException:
        if created and os.path.isdir(out) and not os.listdir(out):
            os.rmdir(out)
        raise
    seconds = time.perf_counter() - start
    files = results[0].files
    size = sum(os.path.getsize(os.path.join(out, f)) for f in files)
    return ConvertReport(out, files, size, seconds, nproc, results, tuple(plan.unused_keys),
                         tuple(s.entry.key for s in ckpt.skipped))


def check_nproc(layout, nproc: int | None, max_nproc: int | None = None) -> int:
    """The number of processes a conversion to `layout` runs: one per rank (None: that many)."""
    from layoutlang.runtime.launch import MAX_PROCESSES

    world = layout.ranks
    nproc = world if nproc is None else nproc
    limit = MAX_PROCESSES if max_nproc is None else max_nproc
    if nproc != world:
        raise UsageError(f"--nproc {nproc}: the layout {layout.path} has {world} rank{'s' if world != 1 else ''}, "
                         "one process each",
                         help=f"use --nproc {world}" + (", or change the layout's sizes with --set" if layout.args else ""))
    if nproc > limit:
        raise UsageError(f"--nproc {nproc}: `layoutc convert` starts at most {limit} local processes "
                         "(each one imports torch and holds its shards)", help=f"pass --max-nproc {nproc} to allow it")
    return nproc


def _failure(failed: tuple[RankResult, ...], results: tuple[RankResult, ...]) -> LayoutError:
    """One error for the failed ranks: said once when they all say the same (a UsageError when
    it is one), else each rank's reason."""
    said = list(dict.fromkeys((r.error, r.help) for r in failed))
    if len(said) == 1:
        message, help_ = said[0]
        if len(failed) < len(results):
            message = f"rank {failed[0].rank}: {message}"
        if all(r.usage for r in failed):
            return UsageError(message, help=help_)
        rendered = failed[0].rendered if len(failed) == len(results) else None
        return ConvertError(message, results, help=help_, rendered=rendered)
    return ConvertError("; ".join(f"rank {r.rank}: {r.error}" for r in failed[:4])
                        + (f"; and {len(failed) - 4} more ranks" if len(failed) > 4 else ""), results)


def _result(w, timeout: float) -> RankResult:
    """A launched rank's outcome as a RankResult (killed at the deadline, crashed, or reported)."""
    data = w.result or {}
    if data.get("ok"):
        return RankResult(w.rank, True, data["read_bytes"], data["written_bytes"], data["seconds"],
                          tuple(data["files"]))
    if data.get("error"):
        return RankResult(w.rank, False, error=data["error"], help=data.get("help"), usage=bool(data.get("usage")),
                          rendered=data.get("rendered"))
    if w.returncode is None:
        return RankResult(w.rank, False, error=f"still running after {timeout:.0f} s: killed (raise --timeout)")
    tail = " | ".join(w.stderr.strip().splitlines()[-3:])
    return RankResult(w.rank, False, error=f"exit code {w.returncode}: {tail}")


def _worker(job_path: str, out_path: str) -> int:
    """One rank of a launched conversion (launch(program=this file)): join gloo, convert, report."""
    import torch.distributed as dist

    from layoutlang.runtime.worker import exit_with_launcher

    exit_with_launcher()
    rank = int(os.environ["RANK"])
    result: dict = {"rank": rank, "ok": False}
    job: dict = {}
    try:
        with open(job_path) as fh:
            job = json.load(fh)
        dist.init_process_group("gloo", rank=rank, world_size=int(os.environ["WORLD_SIZE"]),
                                timeout=timedelta(seconds=job["timeout"]))
        r = convert_rank(job["src"], job["out"], job["layout"], rank=rank, group=dist.group.WORLD,
                         args=job["args"], max_shard_size=job["max_shard_size"], dtype=job["dtype"],
                         overwrite=job["overwrite"], timeout=job["timeout"])
        result.update(ok=True, read_bytes=r.read_bytes, written_bytes=r.written_bytes, seconds=r.seconds,
                      files=list(r.files))
    except LayoutError as e:
        result.update(error=e.message, help=e.help, usage=isinstance(e, UsageError), rendered=e.render())
    except Exception as e:  # noqa: BLE001 - reported to the launcher as data
        result.update(error=f"{type(e).__name__}: {e}", trace=traceback.format_exc())
    with open(out_path, "w") as fh:
        json.dump(result, fh)
    if not result["ok"]:
        time.sleep(2)  # rank 0 hosts the store: its peers must learn the failure, not lose the store
    if dist.is_initialized():
        dist.destroy_process_group()
    return 0 if result["ok"] else 1


__all__ = ["convert", "convert_rank", "preflight", "allocate", "ConvertReport", "ConvertError", "RankResult"]


if __name__ == "__main__":
    from layoutlang.checkpoint.convert import _worker as worker

    sys.exit(worker(sys.argv[1], sys.argv[2]))
