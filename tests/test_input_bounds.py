"""Hostile input stays bounded: what the front end reads, how deep it includes,
and how many tensor statements it takes, each refused with a positioned
diagnostic in seconds (never a hang, a MemoryError or a RecursionError).

The limits (docs/language.md, "Choices where the spec is silent"):

    MAX_FILE_BYTES     a file read (the top-level one or an include) is a regular
                       file of at most 64 MiB; devices, FIFOs, sockets and
                       directories are refused before they are opened
    MAX_INCLUDE_DEPTH  at most 64 nested includes below the top-level file
    MAX_TENSORS        at most 2^20 tensor statements per layout (all its files,
                       loop bodies included), counted before parsing; at most
                       2^20 tensor instances, counted while elaborating

Cases whose input cannot be committed (a FIFO, a 64 MiB file, a chain of 500
files, a million lines) are generated here; the others are golden cases in
tests/diagnostics/ (`include_directory`, `include_device`, `huge_loop`).
"""

from __future__ import annotations

import contextlib
import io
import os
from pathlib import Path

import pytest

import layoutlang
from layoutlang import LayoutError, UsageError
from layoutlang.cli import main
from layoutlang.elaborate import limits

FAST = pytest.mark.timeout(60)  # each finishes in a few seconds; a hang fails, not blocks


def _error(path) -> LayoutError:
    with pytest.raises(LayoutError) as info:
        layoutlang.load(path)
    assert "Traceback" not in info.value.render()
    return info.value


def _check(args: list[str]) -> tuple[int, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(["check", *args])
    return code, out.getvalue() + err.getvalue()


def _including(tmp_path: Path, target: str, name: str = "main.layout") -> Path:
    main_path = tmp_path / name
    main_path.write_text(f'include "{target}"\nmesh m (tp=2)\n')
    return main_path


# ---- what is read: regular files under the size cap ------------------------------

@FAST
@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs FIFOs")
def test_include_of_a_fifo_is_refused_without_opening_it(tmp_path):
    os.mkfifo(tmp_path / "pipe.layout")  # opening it for reading would block forever
    main_path = _including(tmp_path, "pipe.layout")
    err = _error(main_path)
    assert err.render() == (
        f'{main_path}:1:1: error: cannot include "pipe.layout": not a regular file but a FIFO (named pipe)\n'
        '    1 | include "pipe.layout"\n'
        "      | ^^^^^^^^^^^^^^^^^^^^^\n"
        "help: a layout is a regular file: name a `.layout` file, not a device, pipe or socket; "
        f"looked for {tmp_path / 'pipe.layout'}")


@FAST
@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs FIFOs")
def test_top_level_fifo_is_a_usage_error(tmp_path):
    fifo = tmp_path / "pipe.layout"
    os.mkfifo(fifo)
    with pytest.raises(UsageError) as info:
        layoutlang.load(fifo)
    assert info.value.render() == (
        f"error: cannot read {fifo}: not a regular file but a FIFO (named pipe)\n"
        "help: a layout is a regular file: name a `.layout` file, not a device, pipe or socket")
    code, output = _check([str(fifo)])
    assert code == 2 and "not a regular file" in output and "Traceback" not in output


@FAST
@pytest.mark.skipif(not os.path.exists("/dev/zero"), reason="needs /dev/zero")
def test_top_level_device_is_a_usage_error():
    with pytest.raises(UsageError) as info:
        layoutlang.load("/dev/zero")
    assert info.value.message == "cannot read /dev/zero: not a regular file but a character device"
    code, output = _check(["/dev/zero"])
    assert code == 2 and "character device" in output and "Traceback" not in output


@FAST
def test_top_level_directory_is_a_usage_error(tmp_path):
    with pytest.raises(UsageError) as info:
        layoutlang.load(tmp_path)
    assert info.value.message == f"cannot read {tmp_path}: Is a directory"


@FAST
def test_include_of_an_oversized_file_is_refused_before_reading(tmp_path):
    big = tmp_path / "big.layout"
    with open(big, "wb") as fh:  # sparse: 64 MiB + 1 byte on paper, nothing on disk
        fh.truncate(limits.MAX_FILE_BYTES + 1)
    main_path = _including(tmp_path, "big.layout")
    err = _error(main_path)
    assert err.render() == (
        f'{main_path}:1:1: error: cannot include "big.layout": the file has 67108865 bytes; '
        "at most 67108864 bytes (64 MiB) are read\n"
        '    1 | include "big.layout"\n'
        "      | ^^^^^^^^^^^^^^^^^^^^\n"
        "help: a layout file is far smaller: check that the path names the right file; "
        f"looked for {big}")
    with pytest.raises(UsageError) as info:
        layoutlang.load(big)
    assert info.value.message == (f"cannot read {big}: the file has 67108865 bytes; "
                                  "at most 67108864 bytes (64 MiB) are read")


@FAST
def test_a_file_at_the_size_cap_is_read_and_one_byte_more_is_not(tmp_path, monkeypatch):
    text = b"mesh m (tp=2)\ntensor w [8 over tp]\n"
    path = tmp_path / "w.layout"
    path.write_bytes(text)
    monkeypatch.setattr(limits, "MAX_FILE_BYTES", len(text))
    assert len(layoutlang.load(path).tensors) == 1
    monkeypatch.setattr(limits, "MAX_FILE_BYTES", len(text) - 1)
    with pytest.raises(UsageError) as info:
        layoutlang.load(path)
    assert info.value.message == f"cannot read {path}: the file has {len(text)} bytes; at most {len(text) - 1} bytes are read"


@FAST
@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="needs /proc")
def test_a_file_larger_than_its_stat_size_is_read_only_up_to_the_cap(tmp_path, monkeypatch):
    """/proc files report size 0 and are regular: the read itself is bounded."""
    assert os.stat("/proc/self/status").st_size < 64
    monkeypatch.setattr(limits, "MAX_FILE_BYTES", 64)
    main_path = _including(tmp_path, "/proc/self/status")
    err = _error(main_path)
    assert err.message == 'cannot include "/proc/self/status": the file has more than 64 bytes; at most 64 bytes are read'
    assert (err.line, err.col) == (1, 1)


def _fmt(args: list[str]) -> tuple[int, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(["fmt", *args])
    return code, out.getvalue() + err.getvalue()


@FAST
@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs FIFOs")
def test_fmt_refuses_a_fifo_and_an_oversized_file_like_an_unreadable_one(tmp_path):
    """`layoutc fmt` reads with the same bounded reader: a FIFO does not block it,
    a huge file does not exhaust memory; each is a diagnostic, and the others are
    still formatted. A file that cannot be read is a usage error: exit 2 (docs/cli.md
    "Exit codes"), as for `layoutc check`."""
    missing = tmp_path / "missing.layout"
    code, output = _fmt([str(missing)])
    assert code == 2 and f"error: cannot read {missing}: No such file or directory" in output
    fifo, big, ok = tmp_path / "pipe.layout", tmp_path / "big.layout", tmp_path / "ok.layout"
    os.mkfifo(fifo)
    with open(big, "wb") as fh:  # sparse: 64 MiB + 1 byte on paper
        fh.truncate(limits.MAX_FILE_BYTES + 1)
    ok.write_text("mesh m(tp=2)\n")
    code, output = _fmt([str(fifo), str(big), str(ok)])
    assert code == 2 and "Traceback" not in output
    assert f"reformatted {ok}\n" in output
    assert output.endswith(
        f"error: cannot read {fifo}: not a regular file but a FIFO (named pipe)\n"
        "help: a layout is a regular file: name a `.layout` file, not a device, pipe or socket\n"
        f"error: cannot read {big}: the file has 67108865 bytes; at most 67108864 bytes (64 MiB) are read\n"
        "help: a layout file is far smaller: check that the path names the right file\n")
    assert ok.read_text() == "mesh m (tp=2)\n"  # formatted
    code, output = _fmt([str(tmp_path)])  # a folder walked: its FIFO is refused, not opened
    assert code == 2 and "FIFO" in output


@FAST
@pytest.mark.skipif(not os.path.exists("/dev/zero"), reason="needs /dev/zero")
def test_fmt_refuses_a_device():
    code, output = _fmt(["/dev/zero"])
    assert code == 2 and "error: cannot read /dev/zero: not a regular file but a character device" in output


@FAST
def test_fmt_exit_codes_follow_the_documented_table(tmp_path, monkeypatch):
    """docs/cli.md "Exit codes": a file that is not UTF-8 is a diagnostic (1, at its
    line and column); a file that cannot be written is a usage error (2), and the other
    files are still formatted."""
    bad = tmp_path / "bad.layout"
    bad.write_bytes(b"mesh m (tp=2)\n\xff\n")
    code, output = _fmt([str(bad)])
    assert code == 1
    assert output.startswith(f"{bad}:2:1: error: the file is not UTF-8 text (byte 0xff)\n")
    locked, ok = tmp_path / "a_locked.layout", tmp_path / "b_ok.layout"
    locked.write_text("mesh m(tp=2)\n")
    ok.write_text("mesh m(tp=2)\n")
    real_write = Path.write_text

    def write_text(self, *args, **kwargs):
        if self == locked:
            raise PermissionError(13, "Permission denied")
        return real_write(self, *args, **kwargs)

    monkeypatch.setattr(Path, "write_text", write_text)
    code, output = _fmt([str(tmp_path)])
    assert code == 2 and "Traceback" not in output
    assert f"error: cannot write {locked}: Permission denied\n" in output
    assert f"reformatted {ok}\n" in output and f"reformatted {locked}" not in output
    assert locked.read_text() == "mesh m(tp=2)\n" and ok.read_text() == "mesh m (tp=2)\n"


# ---- include depth -----------------------------------------------------------------

def _chain(tmp_path: Path, n: int) -> Path:
    """c0 includes c1 includes ... c{n}; the last declares a mesh and a tensor."""
    for i in range(n):
        (tmp_path / f"c{i}.layout").write_text(f'include "c{i + 1}.layout"\n')
    (tmp_path / f"c{n}.layout").write_text("mesh m (tp=2)\ntensor w [8 over tp]\n")
    return tmp_path / "c0.layout"


@FAST
def test_include_chain_at_the_depth_cap_loads(tmp_path):
    layout = layoutlang.load(_chain(tmp_path, limits.MAX_INCLUDE_DEPTH))
    assert [t.name for t in layout.tensors] == ["w"]


@FAST
def test_include_chain_of_500_stops_at_the_cap_with_a_diagnostic(tmp_path):
    err = _error(_chain(tmp_path, 500))
    deepest = tmp_path / "c64.layout"  # its include would be the 65th nested one
    assert err.render() == (
        f"{deepest}:1:1: error: include depth 65 exceeds the limit of 64 nested includes\n"
        '    1 | include "c65.layout"\n'
        "      | ^^^^^^^^^^^^^^^^^^^^\n"
        "help: include shared files from one place instead of chaining them")


# ---- tensor statements ---------------------------------------------------------------

@FAST
def test_more_tensor_statements_than_the_cap_fail_before_parsing(tmp_path):
    cap = limits.MAX_TENSORS
    path = tmp_path / "many.layout"
    path.write_text("mesh m (tp=2)\n" + "".join(f"tensor w{i} [8 over tp]\n" for i in range(cap + 1)))
    err = _error(path)
    line = cap + 2  # the mesh, then the statement past the cap
    gutter = " " * len(str(line))
    assert err.render() == (
        f"{path}:{line}:1: error: more than {cap} tensor statements; a layout holds at most {cap} "
        "tensor instances\n"
        f"    {line} | tensor w{cap} [8 over tp]\n"
        f"    {gutter} | {'^' * len(f'tensor w{cap}')}\n"
        "help: generate repeated tensors with `for` loops, or check the program that wrote this file")


def test_tensor_statements_are_counted_across_includes_and_loop_bodies(tmp_path, monkeypatch):
    monkeypatch.setattr(limits, "MAX_TENSORS", 5)
    (tmp_path / "inc.layout").write_text(
        "for l in 0..1 {\n  tensor a{l} [1]\n  tensor b{l} [1]\n}\n"
        "tensor c [1]\ntensor d [1]  # the 4th of this file, the 6th of the layout\n")
    main_path = tmp_path / "main.layout"
    main_path.write_text('mesh m (tp=2)\ntensor x [1]\ninclude "inc.layout"\ntensor y [1]\n')
    err = _error(main_path)
    assert err.span.source.path == str(tmp_path / "inc.layout")
    assert (err.line, err.col, err.span.end_col) == (6, 1, 9)
    assert err.message == "more than 5 tensor statements; a layout holds at most 5 tensor instances"
    monkeypatch.setattr(limits, "MAX_TENSORS", 6)
    assert len(layoutlang.load(main_path).tensors) == 6  # x, a0, b0, c, d, y


def test_the_count_skips_comments_paths_and_names_spelled_tensor(monkeypatch):
    monkeypatch.setattr(limits, "MAX_TENSORS", 3)
    text = ('mesh m (tp=2)  # tensor tensor tensor\n'
            'const mytensor = 2, tensor_ = 1\n'
            'tensor tensor.tensor as tensor [mytensor]\n'
            'tensor\n  tensor.x [1] at tp=0tensor y [tensor_]\n')  # `0` then the keyword
    assert [t.name for t in layoutlang.loads(text).tensors] == ["tensor.tensor", "tensor.x", "y"]
    with pytest.raises(LayoutError) as info:
        layoutlang.loads(text + '  tensor z [1]\n')
    assert (info.value.line, info.value.col, info.value.span.end_col) == (6, 3, 11)
    monkeypatch.setattr(limits, "MAX_TENSORS", 2)
    with pytest.raises(LayoutError) as info:
        layoutlang.loads(text)
    assert (info.value.line, info.value.col, info.value.span.end_col) == (5, 23, 31)


def test_instances_past_the_cap_from_loops_keep_their_diagnostic(monkeypatch):
    monkeypatch.setattr(limits, "MAX_TENSORS", 8)
    with pytest.raises(LayoutError) as info:
        layoutlang.loads("mesh m (tp=2)\nfor l in 0..3 {\n  tensor a{l} [1]\n  tensor b{l} [1]\n  tensor c{l} [1]\n}")
    assert info.value.message == "this loop makes 9 tensors; at most 8 per layout are supported"
    assert (info.value.line, info.value.col) == (2, 1)


# ---- the limits together stay inside Python's recursion limit --------------------------

@FAST
def test_every_nesting_limit_at_once_loads_without_recursion_error(tmp_path):
    """The deepest include chain, ending in a file with the deepest expression,
    the deepest product (one level per item), and 30 nested loops whose tensor
    name holds a long `{...}` chain: all at their limits, and it loads."""
    last = ("mesh m (tp=2)\nconst A = " + "1+" * 196 + "1\n"
            "tensor w [(" + "1, " * 63 + "4), " + "-" * 180 + "1+A]\n"
            + "".join(f"for v{k} in 0..1 {{\n" for k in range(30))
            + "tensor x{" + "1+" * 150 + "v29} [(" + "1, " * 63 + "4)]\n" + "}" * 30 + "\n")
    path = _chain(tmp_path, limits.MAX_INCLUDE_DEPTH)
    (tmp_path / f"c{limits.MAX_INCLUDE_DEPTH}.layout").write_text(last)
    layout = layoutlang.load(path)
    assert [t.name for t in layout.tensors] == ["w", "x150"]


def test_a_product_of_more_items_than_the_nesting_limit_is_refused():
    """`(1, 1, ..., 4)` nests a product per item without a bracket; 1000 items
    raised RecursionError before this limit."""
    with pytest.raises(LayoutError) as info:
        layoutlang.loads("mesh m (tp=2)\ntensor w [(" + "1, " * 1000 + "4)]")
    assert info.value.message == "this dimension's structure nests 1001 levels deep; at most 64 are supported"
    assert (info.value.line, info.value.col) == (2, 11)
