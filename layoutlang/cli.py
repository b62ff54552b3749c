"""`layoutc`: the command line. Verbs: check, fmt, plan, explain, run, convert, new.

Exit codes: 0 ok, 1 diagnostics (or `fmt --check` found a file to change),
2 usage errors.
"""

from __future__ import annotations

import argparse
import difflib
import json
import os
import re
import sys
from pathlib import Path

from rich.console import Console
from rich.table import Table

from .version import __version__
from .diagnostics import LayoutError, Note, UsageError
from .elaborate import load, read_source
from .report.units import human_bytes

EXIT_OK, EXIT_DIAGNOSTICS, EXIT_USAGE = 0, 1, 2


def _console(stream) -> Console:
    return Console(file=stream, highlight=False, soft_wrap=True)


def _parse_sets(items: list[str], flag: str = "--set") -> dict[str, int]:
    out = {}
    for item in items or []:
        name, eq, value = item.partition("=")
        name = name.strip()
        if not eq or not name.isidentifier():
            raise UsageError(f"{flag} {item!r}: expected NAME=VALUE, e.g. {flag} TP=4")
        out[name] = _set_value(item, value.strip(), flag)
    return out


def _set_value(item: str, value: str, flag: str):
    """An integer (`TP=4`), a table as JSON (`MAP=[[0,1],[1,0]]`), or a JSON file of one (`MAP=@map.json`):
    data, parsed as data (docs/language.md 14.8); the layout checks the kind."""
    if not value.startswith(("[", "@")):
        try:
            return int(value.replace("_", ""), 10)
        except ValueError:
            raise UsageError(f"{flag} {item!r}: {value!r} is not an integer (or a table: [..] or @FILE.json)") \
                from None
    try:
        text = Path(value[1:]).read_text() if value.startswith("@") else value
        return json.loads(text)
    except OSError as e:
        raise UsageError(f"{flag} {item!r}: cannot read {value[1:]}: {e.strerror}") from None
    except json.JSONDecodeError as e:
        raise UsageError(f"{flag} {item!r}: not a JSON table: {e.msg} at character {e.pos}") from None


def _pair_args(ns) -> tuple[dict[str, int], dict[str, int], dict[str, int]]:
    """(--set for both layouts, --set-src, --set-dst) of a verb that reads a pair."""
    return (_parse_sets(ns.set), _parse_sets(getattr(ns, "set_src", None), "--set-src"),
            _parse_sets(getattr(ns, "set_dst", None), "--set-dst"))


def _report_shared_args(common: dict[str, int], src, dst, err: Console) -> None:
    """`--set` reaches both layouts of a pair: say which of them took each one."""
    for name, value in common.items():
        took = [layout.path for layout in (src, dst) if name in dict(layout.args)]
        where = " and ".join(took) if took else "neither layout"
        err.print(f"note: --set {name}={value} applies to both layouts; taken by {where}"
                  + ("" if len(took) == 2 else " (use --set-src / --set-dst for one side)"), markup=False)


def _add_wire(p) -> None:
    p.add_argument("--wire", choices=("auto", "bf16"), default="auto",
                   help="auto (default): a quantized destination receives its own format (data and "
                        "scales) where an op covers whole scale blocks; bf16: always bf16 "
                        "(compile_plan(wire=...), LANGUAGE.md 4.1)")


def _add_pair_sets(p) -> None:
    p.add_argument("--set", action="append", metavar="NAME=VALUE",
                   help="override an `arg` in each layout that declares it (repeatable)")
    p.add_argument("--set-src", action="append", metavar="NAME=VALUE", help="override an `arg` of SRC only")
    p.add_argument("--set-dst", action="append", metavar="NAME=VALUE", help="override an `arg` of DST only")


def is_checkpoint(path: str) -> bool:
    """Is this side of a pair a checkpoint (a directory of safetensors files, or one file)?"""
    return os.path.isdir(path) or str(path).endswith(".safetensors")


def _pair(src: str, dst: str, args: dict[str, int], src_args: dict[str, int], dst_args: dict[str, int],
          *, strict: bool = True):
    """The sides of a verb that reads a pair, and the checkpoints among them ({"src"|"dst": Checkpoint}).

    Neither a checkpoint: the paths, as given (compile_plan loads and checks them). Otherwise
    loaded layouts: a checkpoint source is its layout with one reader per destination rank,
    every key whole on each (what `load` plans: checkpoint/load.py `reader_layout`); a
    checkpoint destination is the layout it describes (one rank holding every key). A
    checkpoint has no args; `strict`: an arg no layout side declares is a usage error, as
    compile_plan's.
    """
    from .checkpoint import describe
    from .checkpoint.load import reader_layout

    ck = {"src": is_checkpoint(src), "dst": is_checkpoint(dst)}
    if not any(ck.values()):
        return src, dst, {}
    sides = {"src": (src, {**args, **src_args}, src_args, "--set-src"),
             "dst": (dst, {**args, **dst_args}, dst_args, "--set-dst")}
    layouts, ckpts = {}, {}
    for side, (path, given, own, flag) in sides.items():
        if ck[side]:
            if own and strict:
                raise UsageError(f"{flag} {next(iter(own))}: {path} is a checkpoint, which has no args")
            ckpts[side] = describe(path)
        else:
            layouts[side] = load(path, given, unknown_args="ignore")
    if ck["dst"]:
        layouts["dst"] = ckpts["dst"].layout
    if ck["src"]:
        layouts["src"] = reader_layout(ckpts["src"], layouts["dst"].ranks)
    if strict:
        declared = {n for side in layouts if not ck[side] for n, _ in layouts[side].args}
        for name in args:
            if name not in declared:
                raise UsageError(f"--set {name}: neither layout has an arg `{name}`"
                                 + (" (a checkpoint has none)" if len(ckpts) < 2 else " (checkpoints have none)"))
        for side, (path, _, own, flag) in sides.items():
            for name in own if not ck[side] else ():
                if name not in dict(layouts[side].args):
                    raise UsageError(f"{flag} {name}: {layouts[side].path} has no arg `{name}`",
                                     help=f"its args: {', '.join(n for n, _ in layouts[side].args) or 'none'}")
    return layouts["src"], layouts["dst"], ckpts


_MISSING_KEY = re.compile(r"key `(.+)` is not in the source layout ")


def _checkpoint_error(e: LayoutError, ckpts: dict, dst_path: str) -> LayoutError:
    """A plan diagnostic about a key that a checkpoint side lacks or has, said in checkpoint terms.

    A destination key the checkpoint source lacks gets a note when the checkpoint has it but its
    layout leaves it out (an integer tensor, ...). A key of a checkpoint destination is a line of
    text nobody wrote: the help says what to edit instead."""
    m = _MISSING_KEY.match(e.message)
    if not m or not ckpts:
        return e
    key = m.group(1)
    notes, help_ = list(e.notes), e.help
    if "src" in ckpts:
        src = ckpts["src"]
        e_message = f"key `{key}` is not in the checkpoint {src.path}"
        for s in src.skipped:
            if s.entry.key == key:
                notes.append(Note(f"the checkpoint has `{key}` ({s.entry.dtype} {list(s.entry.shape)} in "
                                  f"{s.entry.file}) but leaves it out: {s.reason}"))
    else:
        e_message = e.message
    if "dst" in ckpts:
        help_ = (f"a checkpoint destination takes every key it holds; to plan without `{key}`, write its layout "
                 f"(`layoutc new checkpoint {dst_path} -o ckpt.layout`), delete that tensor or give it the "
                 "source's key with `as KEY`, and plan against that file")
    return type(e)(e_message, e.span, help=help_, notes=tuple(notes))


def _compile(src, dst, ckpts: dict, dst_path: str, **kwargs):
    """compile_plan, its diagnostics about checkpoint sides said in checkpoint terms."""
    from layoutlang.compiler import compile_plan

    try:
        return compile_plan(src, dst, **kwargs)
    except LayoutError as e:
        if not ckpts or isinstance(e, UsageError):
            raise
        raise _checkpoint_error(e, ckpts, dst_path) from None


def _print_error(err: LayoutError, err_console: Console) -> None:
    text = err.render()
    if err_console.is_terminal:
        head, _, rest = text.partition("\n")
        err_console.print(head, style="bold red", markup=False)
        if rest:
            err_console.print(rest, markup=False)
    else:
        err_console.print(text, markup=False)


def cmd_check(ns, out: Console, err: Console) -> int:
    args = _parse_sets(ns.set)
    status = EXIT_OK
    for path in ns.files:
        try:
            layout = load(path, args)
        except UsageError as e:
            _print_error(e, err)
            return EXIT_USAGE
        except LayoutError as e:
            _print_error(e, err)
            status = EXIT_DIAGNOSTICS
            continue
        summarize(layout, out)
    return status


SHOWN_STORED = 8  # stored tensors holding keys (v2) listed by `layoutc check`, one line each


def _has_parts(t) -> bool:
    """Does a v2 tensor cut a non-stacked dim into several keys (part keys)?"""
    r = t.regions[0]
    if r.shape is not None:  # a flat dim's keys (docs/language.md 14.9)
        return False
    return any(hi - lo != t.logical_shape[i] for i, (lo, hi) in enumerate(r.box) if i not in r.stacked)


def summarize(layout, out: Console) -> None:
    per_rank = layout.bytes_per_rank()
    held = [b for b in per_rank if b]
    idle = len(per_rank) - len(held)
    name = f" ({layout.name})" if layout.name else ""
    out.print(f"{layout.path}{name}: ok", markup=False)
    out.print(f"  ranks    {layout.ranks}" + (f" ({idle} idle)" if idle else ""), markup=False)
    for m in layout.meshes:
        axes = ", ".join(f"{a.name}={a.size}" for a in m.axes)
        out.print(f"  mesh     {m.name} ({axes}) ranks {m.offset}..{m.end - 1}", markup=False)
    stored = [t for t in layout.tensors if t.regions is not None]  # v2: keys inside stored tensors
    keys = len(layout.by_key)
    if stored:
        keys = len({k for k, ts in layout.by_key.items() if ts[0].regions is None}
                   | {r.key for t in stored for r in t.regions})
    out.print(f"  tensors  {len(layout.tensors)} instances, {keys} keys", markup=False)
    for t in stored[:SHOWN_STORED]:
        kinds = [w for w, on in (("part keys", _has_parts(t)), ("stacked", bool(t.regions[0].stacked)),
                                 ("transposed", t.regions[0].transposed),
                                 ("flat", t.regions[0].shape is not None)) if on]
        out.print(f"  holds    {t.name}: {len(t.regions)} key{'s' if len(t.regions) != 1 else ''} "
                  f"({', '.join(kinds)})", markup=False)
    if len(stored) > SHOWN_STORED:
        out.print(f"  holds    ... and {len(stored) - SHOWN_STORED} more stored tensors holding "
                  f"{sum(len(t.regions) for t in stored[SHOWN_STORED:])} keys", markup=False)
    if held:
        lo, hi = min(held), max(held)
        lo_r, hi_r = per_rank.index(lo), per_rank.index(hi)
        out.print(f"  bytes    per rank min {human_bytes(lo)} (rank {lo_r}), max {human_bytes(hi)} (rank {hi_r})",
                  markup=False)
    if layout.args:
        out.print("  args     " + ", ".join(f"{n}={v}" for n, v in layout.args), markup=False)


def _highlighted_diff(lines: list[str]):
    """A unified diff for a terminal: +/- marks coloured, the `.layout` text highlighted."""
    from rich.syntax import Syntax
    from rich.text import Text

    from .lexer import LayoutLexer

    syntax = Syntax("", LayoutLexer(), theme="ansi_dark")
    out = Text()
    for line in lines:
        if line.startswith(("+++", "---", "@@")):
            out.append(line, style="bold cyan" if line.startswith("@@") else "bold")
            continue
        mark, body = line[:1], line[1:]
        out.append(mark, style={"+": "bold green", "-": "bold red"}.get(mark, ""))
        highlighted = syntax.highlight(body)
        highlighted.rstrip()
        if mark in "+-":
            highlighted.stylize("on #203020" if mark == "+" else "on #302020")
        out.append_text(highlighted)
        out.append("\n")
    return out


def cmd_fmt(ns, out: Console, err: Console) -> int:
    from .fmt import format_text

    paths: list[Path] = []
    for item in ns.files:
        p = Path(item)
        paths.extend(sorted(p.rglob("*.layout")) if p.is_dir() else [p])
    status = EXIT_OK
    for path in paths:
        try:  # a regular file under the size cap (never a FIFO or a device), as UTF-8
            text = read_source(str(path)).text
        except UsageError as e:  # cannot be read: a usage error (docs/cli.md "Exit codes"); go on
            _print_error(e, err)
            status = max(status, EXIT_USAGE)
            continue
        except LayoutError as e:  # not UTF-8 (positioned)
            _print_error(e, err)
            status = max(status, EXIT_DIAGNOSTICS)
            continue
        try:
            formatted = format_text(text, str(path))
        except LayoutError as e:
            _print_error(e, err)
            status = max(status, EXIT_DIAGNOSTICS)
            continue
        if formatted == text:
            continue
        if ns.check or ns.diff:
            status = max(status, EXIT_DIAGNOSTICS)
            out.print(f"would reformat {path}", markup=False)
            if ns.diff:
                diff = difflib.unified_diff(text.splitlines(True), formatted.splitlines(True),
                                            str(path), str(path) + " (formatted)")
                if out.is_terminal:
                    out.print(_highlighted_diff(list(diff)), end="")
                else:
                    out.print("".join(diff), markup=False, end="")
        else:
            try:
                path.write_text(formatted, "utf-8")
            except OSError as exc:
                _print_error(UsageError(f"cannot write {path}: {exc.strerror or exc}"), err)
                status = max(status, EXIT_USAGE)
                continue
            out.print(f"reformatted {path}", markup=False)
    return status


PLAN_FORMATS = ("text", "json", "dot", "html")


def _silence_stdout() -> None:
    """After a broken pipe, point stdout at /dev/null so the exit flush does not fail again."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError, AttributeError):
        pass


class _Progress:
    """rich progress bars on stderr for long compiles: only on a terminal, never in CI or with --quiet."""

    def __init__(self, err: Console, quiet: bool):
        self.bar = None
        if not quiet and err.is_terminal and not os.environ.get("CI"):
            from rich.progress import BarColumn, Progress, TaskProgressColumn, TextColumn, TimeElapsedColumn
            self.bar = Progress(TextColumn("{task.description:<10}"), BarColumn(), TaskProgressColumn(),
                                TimeElapsedColumn(), console=err, transient=True)
        self.tasks: dict[str, int] = {}

    def __enter__(self):
        if self.bar:
            self.bar.__enter__()
        return self

    def __exit__(self, *exc):
        if self.bar:
            self.bar.__exit__(*exc)

    def __call__(self, stage: str, done: int, total: int) -> None:
        if self.bar is None:
            return
        if stage not in self.tasks:
            self.tasks[stage] = self.bar.add_task(stage, total=max(total, 1))
        self.bar.update(self.tasks[stage], completed=done, total=max(total, 1))


def cmd_plan(ns, out: Console, err: Console) -> int:
    from layoutlang.compiler import compile_plan
    from layoutlang.compiler.select import SELECTORS
    from layoutlang.report.render import check_rank, iter_json, render_dot, render_steps, render_text, unused_warning

    args, src_args, dst_args = _pair_args(ns)
    if ns.selector not in SELECTORS:
        raise UsageError(f"--selector {ns.selector}: expected one of {', '.join(sorted(SELECTORS))}")
    if ns.ranks_per_node is not None and ns.ranks_per_node < 1:
        raise UsageError(f"--ranks-per-node {ns.ranks_per_node}: expected a positive integer")
    if ns.rank is not None and ns.format in ("dot", "html"):
        raise UsageError(f"--rank filters ops in text and json output; {ns.format} shows the whole plan")
    if ns.steps and (ns.rank is None or ns.format != "text"):
        raise UsageError("--steps lists one rank's steps as text", help="add --rank R (and no --format)")
    if ns.budget is not None and ns.budget < 1:
        raise UsageError(f"--budget {ns.budget}: expected a positive number of bytes")
    src, dst, ckpts = _pair(ns.src, ns.dst, args, src_args, dst_args)
    with _Progress(err, ns.quiet) as progress:
        if ckpts:  # both sides are loaded layouts, their args applied and checked
            plan = _compile(src, dst, ckpts, ns.dst, ranks_per_node=ns.ranks_per_node, selector=ns.selector,
                            progress=progress, split=not ns.no_split, wire=ns.wire, relay=not ns.no_relay)
        else:
            plan = compile_plan(ns.src, ns.dst, args=args, src_args=src_args, dst_args=dst_args,
                                ranks_per_node=ns.ranks_per_node, selector=ns.selector, progress=progress,
                                split=not ns.no_split, wire=ns.wire, relay=not ns.no_relay)
    _report_shared_args(args, plan.src, plan.dst, err)
    check_rank(plan, ns.rank)
    if ns.format == "json":
        chunks = iter_json(plan, ns.rank)
    elif ns.format == "dot":
        chunks = iter([render_dot(plan)])
    elif ns.format == "html":
        from layoutlang.report.html_page import render_html

        chunks = iter([render_html(plan)])
    elif ns.steps:
        chunks = iter([render_steps(plan, ns.rank, ns.budget)])
    else:
        chunks = iter([render_text(plan, ns.rank)])
    warning = unused_warning(plan)
    if warning:
        err.print(warning, style="yellow" if err.is_terminal else None, markup=False)
    if ns.output is None:
        try:
            for chunk in chunks:
                out.file.write(chunk)
            out.file.flush()
        except BrokenPipeError:  # `layoutc plan ... | head`: the reader has what it wanted
            _silence_stdout()
        return EXIT_OK
    try:
        first = next(chunks)  # render errors surface before the file is touched
        with open(ns.output, "w", encoding="utf-8", newline="\n") as fh:
            fh.write(first)
            for chunk in chunks:
                fh.write(chunk)
    except OSError as exc:
        raise UsageError(f"-o {ns.output}: cannot write: {exc.strerror or exc}") from None
    return EXIT_OK


def cmd_run(ns, out: Console, err: Console) -> int:
    """Refit across N local gloo processes and check every destination element."""
    import time

    from layoutlang.compiler import compile_plan
    from layoutlang.runtime.launch import MAX_PROCESSES, launch

    limit = ns.max_nproc if ns.max_nproc is not None else MAX_PROCESSES
    if ns.nproc < 1 or ns.nproc > limit:
        raise UsageError(f"--nproc {ns.nproc}: `layoutc run` starts between 1 and {limit} local processes "
                         "(each one imports torch, about 300 MB)",
                         help=f"pass --max-nproc {ns.nproc} to allow it" if ns.nproc > limit else None)
    for side, path in (("SRC", ns.src), ("DST", ns.dst)):
        if is_checkpoint(path):
            raise UsageError(f"{side} {path}: `layoutc run` fills and checks layouts with generated data, "
                             "not a checkpoint",
                             help=f"preview a load with `layoutc plan {path} LAYOUT`; rewrite a checkpoint with "
                                  f"`layoutc convert {path} -o OUT --to LAYOUT`")
    from layoutlang.runtime.transport import transport_class

    transport_class(ns.transport)  # an unknown name: the UsageError naming the known ones, before any process
    args, src_args, dst_args = _pair_args(ns)
    plan = compile_plan(ns.src, ns.dst, args=args, src_args=src_args, dst_args=dst_args,
                        ranks_per_node=ns.ranks_per_node, wire=ns.wire, relay=not ns.no_relay)
    _report_shared_args(args, plan.src, plan.dst, err)
    if ns.nproc < plan.world:
        raise UsageError(f"--nproc {ns.nproc}: the plan spans {plan.world} ranks",
                         help=f"use --nproc {plan.world} or more, or smaller layouts (--set)")
    job = {"src": os.path.abspath(ns.src), "dst": os.path.abspath(ns.dst), "args": args,
           "src_args": src_args, "dst_args": dst_args,
           "verify": ns.verify, "budget": ns.budget, "steps": ns.steps, "timeout": ns.timeout,
           "ranks_per_node": ns.ranks_per_node, "wire": ns.wire, "relay": not ns.no_relay,
           "overlap": ns.overlap, "steady": ns.steady, "transport": ns.transport}
    out.print(f"refit {ns.src} -> {ns.dst}: {plan.stats['tensors']} tensors, {plan.stats['ops']} ops, "
              f"{human_bytes(plan.stats['bytes'])} on {ns.nproc} gloo processes", markup=False)
    start = time.perf_counter()
    results = launch(job, ns.nproc, timeout=ns.timeout * 2 + 120)
    wall = time.perf_counter() - start
    failed = [r for r in results if not r.ok]
    table = Table(show_edge=False, box=None)
    for col in ("rank", "sent", "received", "local", "refit s", "checked"):
        table.add_column(col, justify="right")
    slowest = 0.0
    for r in results:
        res = r.result or {}
        secs = min(res.get("seconds") or [0.0])
        slowest = max(slowest, secs)
        table.add_row(str(r.rank), human_bytes(res.get("sent_bytes", 0)), human_bytes(res.get("received_bytes", 0)),
                      human_bytes(res.get("local_bytes", 0)), f"{secs:.3f}",
                      "ok" if r.ok else "FAILED")
    out.print(table)
    moved = plan.stats["bytes"]
    rate = moved / slowest / 1e9 if slowest else 0.0
    modes = sorted({m for r in results for m in [(r.result or {}).get("transport_mode")] if m})
    out.print(f"refit time {slowest:.3f} s (slowest rank, best of {ns.steps}), {rate:.3f} GB/s; "
              f"wall {wall:.1f} s with process start-up; transport {ns.transport}"
              + (f" ({', '.join(modes)})" if modes else ""), markup=False)
    if failed:
        for r in failed:
            err.print(f"rank {r.rank}: {r.error or (r.result or {}).get('check_errors')}", markup=False)
        return EXIT_DIAGNOSTICS
    checked = sum((r.result or {}).get("checked_tensors", 0) for r in results)
    out.print(f"every element of {checked} destination tensors checked: ok"
              + (" (verified by checksums too)" if ns.verify else ""), markup=False)
    return EXIT_OK


def cmd_convert(ns, out: Console, err: Console) -> int:
    """Rewrite a checkpoint in another layout or format on N local processes (checkpoint/convert.py)."""
    from .checkpoint.convert import DEFAULT_TIMEOUT, check_nproc, convert, preflight

    if ns.timeout is not None and ns.timeout <= 0:
        raise UsageError(f"--timeout {ns.timeout}: expected a positive number of seconds")
    if ns.nproc is not None and ns.nproc < 1:
        raise UsageError(f"--nproc {ns.nproc}: expected at least 1 process")
    args = _parse_sets(ns.set)
    if ns.max_shard_size.strip().isdigit():  # a number of bytes (parse_size takes digits with a unit)
        ns.max_shard_size = int(ns.max_shard_size)
    try:
        checked = preflight(ns.src, ns.output, ns.to, args=args, max_shard_size=ns.max_shard_size,
                            dtype=ns.dtype, overwrite=ns.overwrite)
    except LayoutError as e:
        if isinstance(e, UsageError) or not _MISSING_KEY.match(e.message):
            raise
        from .checkpoint import describe

        raise _checkpoint_error(e, {"src": describe(ns.src)}, ns.output) from None
    ckpt, layout, plan, files = checked
    nproc = check_nproc(layout, ns.nproc, ns.max_nproc)
    unused = list(plan.unused_keys)
    if unused:
        err.print(f"warning: {len(unused)} checkpoint key{'s are' if len(unused) != 1 else ' is'} not in "
                  f"{layout.path}, not written: {', '.join(unused[:5])}" + (", ..." if len(unused) > 5 else ""),
                  markup=False)
    if ckpt.skipped:
        shown = ", ".join(f"{s.entry.key} ({s.entry.dtype})" for s in ckpt.skipped[:5])
        err.print(f"warning: {len(ckpt.skipped)} checkpoint key{'s' if len(ckpt.skipped) != 1 else ''} "
                  f"the layout language cannot hold, not written: {shown}"
                  + (", ..." if len(ckpt.skipped) > 5 else ""), markup=False)
    report = convert(ns.src, ns.output, ns.to, args=args, nproc=nproc, max_shard_size=ns.max_shard_size,
                     dtype=ns.dtype, overwrite=ns.overwrite, timeout=ns.timeout or DEFAULT_TIMEOUT,
                     max_nproc=ns.max_nproc, checked=checked)
    count = len(report.files)
    out.print(f"wrote {ns.output}: {count} file{'s' if count != 1 else ''}, {human_bytes(report.bytes)} "
              f"({report.bytes} B), {sum(len(f.keys) for f in files)} keys of {ns.to or 'the checkpoint'}"
              + (f" as {ns.dtype}" if ns.dtype else "")
              + f", in {report.seconds:.1f} s on {report.nproc} process{'es' if report.nproc != 1 else ''}",
              markup=False)
    return EXIT_OK


def cmd_explain(ns, out: Console, err: Console) -> int:
    from layoutlang.report.explain import explain

    if len(ns.items) not in (2, 3):
        raise UsageError("expected SRC [DST] KEY", help="e.g. layoutc explain train.layout infer.layout "
                                                        "decoder.layers.0.mlp.linear_fc1.weight")
    args, src_args, dst_args = _pair_args(ns)
    src_path, key = ns.items[0], ns.items[-1]
    dst = plan = None
    if len(ns.items) == 3:
        src, dst, ckpts = _pair(src_path, ns.items[1], args, src_args, dst_args, strict=False)
        if not ckpts:
            src = load(src_path, {**args, **src_args}, unknown_args="ignore")
            dst = load(ns.items[1], {**args, **dst_args}, unknown_args="ignore")
        plan = _compile(src, dst, ckpts, ns.items[1])
        _report_shared_args(args, src, dst, err)
    elif is_checkpoint(src_path):
        from .checkpoint import describe

        src = describe(src_path).layout
    else:
        src = load(src_path, {**args, **src_args}, unknown_args="ignore")
    world = plan.world if plan else src.ranks
    if ns.rank is not None and not 0 <= ns.rank < world:
        raise UsageError(f"--rank {ns.rank}: the layouts span ranks 0..{world - 1}")
    out.print(explain(src, key, dst, plan, ns.rank))
    return EXIT_OK


def _read_config(path: str) -> dict:
    """config.json as a dict: unreadable, not JSON or not an object is a UsageError (exit 2)."""
    import json

    from .diagnostics import Source, Span

    try:
        text = read_source(path).text  # a regular file under the size cap, UTF-8
    except UsageError:
        raise
    except LayoutError as e:  # not UTF-8: positioned, but still a bad --config
        raise UsageError(e.message, e.span, help=e.help) from None
    try:
        config = json.loads(text)
    except json.JSONDecodeError as e:
        line_end = text.find("\n", e.pos)
        span = Span(Source(path, text), e.lineno, e.colno, e.lineno,
                    e.colno + max(1, min(line_end if line_end >= 0 else len(text), e.pos + 1) - e.pos))
        raise UsageError(f"--config {path}: not JSON: {e.msg}", span,
                         help="pass the model's config.json (from its HF repository)") from None
    if not isinstance(config, dict):
        raise UsageError(f"--config {path}: expected a JSON object (a model's config.json), "
                         f"got a JSON {type(config).__name__}")
    return config


def cmd_new(ns, out: Console, err: Console) -> int:
    """Print (or write) the `.layout` of a known model family in a framework's convention, or of a checkpoint."""
    from .bridges.families import arg_names, model_from_config
    from .bridges.flat_layout import render  # every convention; deepspeed / fsdp1 there, the others in families

    if ns.framework == "checkpoint":
        return _new_checkpoint(ns, out)
    if ns.directory is not None or ns.config is None:
        raise UsageError(f"layoutc new {ns.framework} takes --config CONFIG_JSON" +
                         (f", not a directory ({ns.directory})" if ns.directory is not None else ""),
                         help="a checkpoint directory goes with `layoutc new checkpoint DIR`")
    split_sets, other_sets = _split_sets(ns.set)
    sizes = {**_parse_sets(other_sets), **split_sets}
    model = model_from_config(_read_config(ns.config), source=ns.config)
    text = render(model, ns.framework, sizes, ns.expert_placement, ns.redundant_experts)
    where = ns.output or f"<layoutc new {ns.framework}>"
    from .elaborate import loads

    layout = loads(text, where)  # sizes that do not divide are diagnostics in the generated text (exit 1)
    stages = _stages_line(model, ns.framework, sizes)
    if stages and stages[1]:   # layoutc picked Megatron's split: say so, wherever the text goes
        err.print(f"note: {stages[0]}", markup=False)
    if not _write_new(ns, out, text):
        return EXIT_OK
    args = ", ".join(f"{n}={_arg_summary(v)}" for n, v in layout.args)
    change = f"--set {arg_names(model, ns.framework)[0]}=..."
    if layout.args:
        change = f"change them with {change}"
    else:  # deepspeed / fsdp1: the sizes written as numbers, as their live bridges write them
        args = ", ".join(f"{n}={sizes.get(n, 1 if n == 'DP' else 0)}" for n in arg_names(model, ns.framework))
        change = f"numbers in the text: regenerate with {change}"
    first = min(m.offset for m in layout.meshes)
    ranks = f"rank {first}" if layout.ranks - first == 1 else f"ranks {first}..{layout.ranks - 1}"
    out.print(f"wrote {ns.output}: {model.model_type} in the {ns.framework} convention, "
              f"{len(layout.tensors)} tensor instances on {ranks} ({args}; {change})"
              + (f"; {stages[0]}" if stages and not stages[1] else ""), markup=False)
    return EXIT_OK


def _split_sets(items: list[str] | None) -> tuple[dict, list[str]]:
    """`layoutc new megatron`'s Megatron pipeline split args (bridges/megatron_split.py) out of --set:
    the layout a string as Megatron takes it (or a JSON list of lists), the accounting flags 1/0 or
    true/false, the stage sizes integers; and the other --set items."""
    from .bridges.megatron_split import FLAGS, LAYOUT, SPLIT_ARGS

    split, rest = {}, []
    for item in items or []:
        name, eq, value = (x.strip() for x in item.partition("="))
        if name not in SPLIT_ARGS or not eq:
            rest.append(item)
        elif name == LAYOUT:
            split[name] = _set_value(item, value, "--set") if value.startswith(("[", "@")) else value
        elif name in FLAGS and value.lower() in ("true", "false"):
            split[name] = value.lower() == "true"
        else:
            split[name] = _set_value(item, value, "--set")
    return split, rest


def _stages_line(model, framework: str, sizes: dict) -> tuple[str, bool] | None:
    """Megatron's uneven pipeline stages in words, and whether layoutc chose them; None if even."""
    from .bridges.megatron_split import SPLIT_ARGS, pipeline_split

    if framework != "megatron":
        return None
    split = pipeline_split(model.layers, sizes.get("PP", 1), {k: v for k, v in sizes.items() if k in SPLIT_ARGS})
    if split.even:
        return None
    said = f"pipeline stages of {'/'.join(map(str, split.stages))} layers (Megatron-LM: {' '.join(split.flags)})"
    if split.chosen:
        said = (f"PP={sizes['PP']} does not divide the {model.layers} layers: {said}; run the trainer with "
                "these flags or choose the split with --set decoder_first_pipeline_num_layers=N ...")
    return said, split.chosen


def _arg_summary(value) -> str:
    """An arg's value in one line: an integer as it is, a table by its lengths (`[2 x 6]`)."""
    if not isinstance(value, tuple):
        return str(value)
    lengths = []
    while isinstance(value, tuple):
        lengths.append(str(len(value)))
        value = value[0] if value else None
    return f"[{' x '.join(lengths)} table]"


def _write_new(ns, out: Console, text: str) -> bool:
    """`layoutc new`'s text to standard output (False) or to -o FILE (True: the caller says what it wrote)."""
    if ns.output is None:
        try:
            out.file.write(text)
            out.file.flush()
        except BrokenPipeError:
            _silence_stdout()
        return False
    try:
        with open(ns.output, "w", encoding="utf-8", newline="\n") as fh:
            fh.write(text)
    except OSError as exc:
        raise UsageError(f"-o {ns.output}: cannot write: {exc.strerror or exc}") from None
    return True


def _new_checkpoint(ns, out: Console) -> int:
    """`layoutc new checkpoint DIR`: the layout a safetensors directory describes (headers only)."""
    from .checkpoint import describe

    if ns.directory is None or ns.config is not None or ns.set:
        raise UsageError("layoutc new checkpoint takes a directory (DIR), and neither --config nor --set",
                         help="layoutc new checkpoint path/to/checkpoint")
    ckpt = describe(ns.directory)
    ckpt.layout  # the text is checked before it is printed
    if _write_new(ns, out, ckpt.text):
        out.print(f"wrote {ns.output}: the checkpoint {ns.directory}, {len(ckpt.tensors)} tensors in "
                  f"{len(ckpt.files)} files on rank 0" +
                  (f" ({len(ckpt.skipped)} keys skipped, see the file)" if ckpt.skipped else ""), markup=False)
    return EXIT_OK


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="layoutc", description="Check, format and plan `.layout` sharding specs.")
    parser.add_argument("--version", action="version", version=f"layoutc {__version__}")
    sub = parser.add_subparsers(dest="verb", metavar="VERB")
    sub.required = True
    check = sub.add_parser("check", help="check layouts and print a short summary",
                           description="Check each layout and print ranks, meshes, tensors and "
                                       "bytes per rank, or diagnostics.")
    check.add_argument("files", nargs="+", metavar="FILE")
    check.add_argument("--set", action="append", metavar="NAME=VALUE",
                       help="override an `arg` (repeatable)")
    check.set_defaults(run=cmd_check)
    fmt = sub.add_parser("fmt", help="rewrite layouts in the canonical style",
                         description="Rewrite each layout (or every *.layout under a folder) in "
                                     "the canonical style; comments are kept.")
    fmt.add_argument("files", nargs="+", metavar="FILE")
    fmt.add_argument("--check", action="store_true",
                     help="change nothing; exit 1 if a file would be reformatted")
    fmt.add_argument("--diff", action="store_true", help="change nothing; print a unified diff")
    fmt.set_defaults(run=cmd_fmt)
    plan = sub.add_parser("plan", help="compile the transfer plan between two layouts",
                          description="Compile the plan that moves every destination tensor's data "
                                      "from the source layout, and print a report (text), the "
                                      "plan itself (json), rank-to-rank traffic (dot) or a "
                                      "report with pictures (html).")
    plan.add_argument("src", metavar="SRC", help="the source layout (e.g. the trainer), or a checkpoint (a directory "
                                                 "of safetensors files, or one): the preview of a load")
    plan.add_argument("dst", metavar="DST", help="the destination layout (e.g. the inference engine), or a "
                                                 "checkpoint (its own layout: one rank holding every key)")
    _add_pair_sets(plan)
    plan.add_argument("--format", choices=PLAN_FORMATS, default="text",
                      help="text (default): a report; json: the plan; dot: a Graphviz traffic graph; "
                           "html: a self-contained page with pictures (use -o plan.html)")
    plan.add_argument("-o", "--output", metavar="FILE", help="write to FILE instead of standard output")
    plan.add_argument("--rank", type=int, metavar="R",
                      help="text and json: only the ops rank R sends or receives")
    plan.add_argument("--ranks-per-node", type=int, metavar="N",
                      help="ranks r and s share a node when r // N == s // N: prefer senders on the "
                           "receiver's node and report intra-/inter-node bytes")
    plan.add_argument("--quiet", "-q", action="store_true",
                      help="no progress bars (they only show on a terminal, never in CI)")
    plan.add_argument("--no-split", action="store_true",
                      help="keep every piece whole: never cut a piece among idle replicas to balance the "
                           "senders (compile_plan(split=False))")
    _add_wire(plan)
    plan.add_argument("--steps", action="store_true",
                      help="with --rank R: the steps rank R executes, bucket by bucket, one line each "
                           "(what the runtime walks)")
    plan.add_argument("--budget", type=int, default=None, metavar="BYTES",
                      help="with --steps: the staging budget per rank that cuts the buckets (as `layoutc run "
                           "--budget`)")
    plan.add_argument("--no-relay", action="store_true",
                      help="every op leaves a source rank: never forward a piece through a destination "
                           "replica that received it (compile_plan(relay=False))")
    plan.add_argument("--selector", default="balanced", metavar="NAME",
                      help="how a sender is chosen among the replicas: balanced (default) or "
                           "round_robin")
    plan.set_defaults(run=cmd_plan)
    exp = sub.add_parser("explain", help="picture one tensor: parts, who holds what, the ops that move it",
                         description="Show one tensor (by KEY): its logical shape and parts, which ranks "
                                     "hold which block in SRC (and DST), and with DST the ops that move it.")
    exp.add_argument("items", nargs="+", metavar="SRC [DST] KEY",
                     help="SRC and DST: layouts, or checkpoints (a directory of safetensors files, or one)")
    exp.add_argument("--rank", type=int, default=None, help="only this rank's shards and ops")
    _add_pair_sets(exp)
    exp.set_defaults(run=cmd_explain)
    run = sub.add_parser("run", help="refit across local gloo processes and check every element",
                         description="Spawn N local gloo processes, fill the source with deterministic "
                                     "data, refit, and check every destination element.")
    run.add_argument("src", metavar="SRC")
    run.add_argument("dst", metavar="DST")
    run.add_argument("--nproc", type=int, required=True, help="processes to spawn (>= the plan's ranks)")
    _add_pair_sets(run)
    run.add_argument("--verify", action="store_true", help="also compare checksums of every transfer")
    run.add_argument("--budget", type=int, default=None, metavar="BYTES", help="staging budget per rank")
    run.add_argument("--no-relay", action="store_true",
                     help="plan without relays (as `layoutc plan --no-relay`)")
    run.add_argument("--steps", type=int, default=1, help="refit this many times (time the best)")
    run.add_argument("--max-nproc", type=int, default=None, metavar="N",
                     help="allow more than 64 local processes")
    run.add_argument("--timeout", type=int, default=60, metavar="SECONDS",
                     help="how long any rank waits for its peers")
    run.add_argument("--ranks-per-node", type=int, default=None, metavar="N")
    _add_wire(run)
    run.add_argument("--overlap", action="store_true",
                     help="finish each bucket (land, quantize, unpack) while the next bucket's transfers fly; "
                          "buckets are cut at half the budget (Refitter(overlap=True))")
    run.add_argument("--steady", action="store_true",
                     help="no store meeting after the first step that passes on every rank (Refitter(steady=True); "
                          "a later failure stops its peers after bytes moved)")
    run.add_argument("--transport", default="auto", metavar="NAME",
                     help="how the processes move their messages: auto (default: shared memory, all being on "
                          "this host), group (gloo), memory, nixl (docs/runtime.md \"Transports\")")
    run.set_defaults(run=cmd_run)
    conv = sub.add_parser("convert", help="rewrite a checkpoint in another layout or format",
                          description="Load a safetensors checkpoint into LAYOUT's shards on N local gloo "
                                      "processes (one per rank of LAYOUT) and save them as an HF checkpoint "
                                      "in OUT: another layout (fused, sharded, quantized keys) or another "
                                      "format (--dtype).")
    conv.add_argument("src", metavar="SRC", help="the checkpoint: a directory of safetensors files, or one file")
    conv.add_argument("-o", "--output", required=True, metavar="OUT", help="the directory to write")
    conv.add_argument("--to", metavar="LAYOUT",
                      help="the layout the processes hold and save (default: the checkpoint's own, one rank)")
    conv.add_argument("--nproc", type=int, default=None, metavar="N",
                      help="processes, one per rank of LAYOUT (the default); 1 runs in this process")
    conv.add_argument("--set", action="append", metavar="NAME=VALUE", help="override an `arg` of LAYOUT (repeatable)")
    conv.add_argument("--max-shard-size", default="5GB", metavar="SIZE",
                      help="bytes per file, as save_pretrained: 5GB (default), 500MiB, 1000000")
    conv.add_argument("--dtype", default=None, metavar="DTYPE",
                      help="write every key in DTYPE (bf16, fp16, fp32, fp8_e4m3, fp8_e5m2, fp8_b128, mxfp8, mxfp4); "
                           "default: each tensor's dtype in LAYOUT")
    conv.add_argument("--overwrite", action="store_true", help="replace a checkpoint already in OUT")
    conv.add_argument("--timeout", type=float, default=None, metavar="SECONDS",
                      help="how long a rank waits for its peers (default 600); with 30 s for start-up, the "
                           "whole conversion's deadline")
    conv.add_argument("--max-nproc", type=int, default=None, metavar="N", help="allow more than 64 local processes")
    conv.set_defaults(run=cmd_convert)
    from .bridges.families import CONVENTIONS, FAMILIES, TRAINER_CONVENTIONS

    new = sub.add_parser("new", help="write the layout of a known model from its config.json, or of a checkpoint",
                         description="Write the `.layout` of a model (a HF config.json of a known family: "
                                     f"{', '.join(FAMILIES)}) as FRAMEWORK stores it, with its parallel "
                                     "sizes as args (TP, PP, DP, EP, ETP, AT). Keys are the HF checkpoint "
                                     "names, so any two outputs for one config plan with each other (but "
                                     "fsdp1, whose q/k rows are plain as its live bridge writes them: "
                                     "docs/bridges.md).")
    new.add_argument("framework", choices=(*CONVENTIONS, *TRAINER_CONVENTIONS, "checkpoint"), metavar="FRAMEWORK",
                     help=f"one of {', '.join(CONVENTIONS + TRAINER_CONVENTIONS)} (hf: the checkpoint; hf-memory: a "
                          "transformers model in memory, experts stacked; torchtitan: its live parameters, "
                          "Llama3 / Qwen3 / DeepSeek-V3 only; deepspeed: a ZeRO-3 trainer's flat partitions, "
                          "fsdp1: a torch FSDP1 trainer's flat units, each the text its live bridge's "
                          "describe() writes), or checkpoint DIR: the layout "
                          "a safetensors directory describes, from its headers")
    new.add_argument("directory", nargs="?", metavar="DIR", help="with `checkpoint`: the checkpoint directory")
    new.add_argument("--config", metavar="CONFIG_JSON", help="the model's config.json (every FRAMEWORK but "
                                                             "checkpoint)")
    new.add_argument("--set", action="append", metavar="NAME=VALUE",
                     help="an arg's value in the output, e.g. --set TP=4 (repeatable; deepspeed and fsdp1 "
                          "take DP=W and AT, fsdp1 also ORIG=1 for use_orig_params=True); megatron also takes "
                          "Megatron-LM's pipeline split: decoder_first_pipeline_num_layers=N, "
                          "decoder_last_pipeline_num_layers=N, account_for_embedding_in_pipeline_split=1, "
                          "account_for_loss_in_pipeline_split=1 or pipeline_model_parallel_layout=LAYOUT")
    new.add_argument("-o", "--output", metavar="FILE", help="write to FILE instead of standard output")
    new.add_argument("--expert-placement", choices=("linear", "round_robin"), default="linear",
                     help="vllm only: vLLM's --expert-placement-strategy (docs/language.md 14.8)")
    new.add_argument("--redundant-experts", type=int, default=0, metavar="R",
                     help="vllm only: EPLB's num_redundant_experts; the experts are then placed by the table "
                          "arg EPLB (docs/language.md 14.8)")
    new.set_defaults(run=cmd_new)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    try:
        ns = parser.parse_args(argv)
    except SystemExit as e:
        return int(e.code or 0)
    out, err = _console(sys.stdout), _console(sys.stderr)
    try:
        return ns.run(ns, out, err)
    except UsageError as e:
        _print_error(e, err)
        return EXIT_USAGE
    except LayoutError as e:
        _print_error(e, err)
        return EXIT_DIAGNOSTICS


if __name__ == "__main__":
    sys.exit(main())
