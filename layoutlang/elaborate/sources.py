"""Which texts make a layout: files read within bounds, includes resolved once.

Guarantees:

- a file is read only if it is a regular file of at most `limits.MAX_FILE_BYTES`:
  its type is checked before opening (opening a FIFO blocks) and again on the
  descriptor, and the read itself is bounded (a /proc file reports size 0);
- includes are relative to the including file, nest at most
  `limits.MAX_INCLUDE_DEPTH` deep, never form a cycle, and a file included
  twice is taken once;
- `tensor` statements of all the layout's files together are counted before each
  file is parsed: the statement past `limits.MAX_TENSORS` fails before a parse;
- every text read is kept, once, in reading order (the layout's digest and its
  `sources`).
"""

from __future__ import annotations

import errno
import hashlib
import os
import stat

from .. import ast
from ..diagnostics import ElaborationError, Source, UsageError
from ..parser import decode, parse_source
from . import limits


class FileRefused(Exception):
    """A path that is not a layout file we will read: `reason` completes
    "cannot read PATH: ...", `help` says what to do (None: the path is wrong)."""

    def __init__(self, reason: str, help: str | None = None):
        super().__init__(reason)
        self.reason, self.help = reason, help


_KINDS = ((stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
          (stat.S_ISFIFO, "a FIFO (named pipe)"), (stat.S_ISSOCK, "a socket"))


def _not_regular(mode: int) -> FileRefused:
    if stat.S_ISDIR(mode):
        return FileRefused(os.strerror(errno.EISDIR))
    kind = next((word for test, word in _KINDS if test(mode)), "not a regular file")
    return FileRefused(f"not a regular file but {kind}" if kind.startswith("a ") else kind,
                       help="a layout is a regular file: name a `.layout` file, not a device, pipe or socket")


def _too_large(size: str) -> FileRefused:
    cap = limits.MAX_FILE_BYTES
    shown = f"{cap} bytes"
    if cap >= 1 << 20 and cap % (1 << 20) == 0:
        shown += f" ({cap >> 20} MiB)"
    return FileRefused(f"the file has {size} bytes; at most {shown} are read",
                       help="a layout file is far smaller: check that the path names the right file")


def _read_at_most(fh, expected: int, limit: int) -> bytes:
    """Up to `limit` bytes: one read when the file has the size `stat` gave, else
    chunks (a buffer of `limit` bytes up front would cost 64 MiB per file)."""
    data = fh.read(min(expected + 1, limit))
    if len(data) <= expected:
        return data
    parts, total = [data], len(data)
    while total < limit:
        chunk = fh.read(min(1 << 20, limit - total))
        if not chunk:
            break
        parts.append(chunk)
        total += len(chunk)
    return b"".join(parts)


def read_layout_file(path: str) -> bytes:
    """The bytes of a regular file of at most MAX_FILE_BYTES, else FileRefused.

    The type is checked with `stat` before opening (opening a FIFO blocks) and
    again on the open descriptor (the path may change in between); at most
    MAX_FILE_BYTES + 1 bytes are read, so a file that grows, or a /proc file
    that reports size 0, cannot exhaust memory.
    """
    cap = limits.MAX_FILE_BYTES
    try:
        st = os.stat(path)
        if not stat.S_ISREG(st.st_mode):
            raise _not_regular(st.st_mode)
        if st.st_size > cap:
            raise _too_large(str(st.st_size))
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0))
        with os.fdopen(fd, "rb") as fh:
            mode = os.fstat(fh.fileno()).st_mode
            if not stat.S_ISREG(mode):
                raise _not_regular(mode)
            data = _read_at_most(fh, st.st_size, cap + 1)
    except OSError as exc:
        raise FileRefused(exc.strerror or str(exc)) from None
    except ValueError:  # a NUL in the path
        raise FileRefused("a path cannot contain a NUL character") from None
    if len(data) > cap:
        raise _too_large(f"more than {cap}")
    return data


def read_source(path: str) -> Source:
    """A top-level layout file's text: UsageError if it cannot be read (`load`,
    `layoutc fmt`), a positioned ParseError if it is not UTF-8."""
    try:
        data = read_layout_file(path)
    except FileRefused as exc:
        raise UsageError(f"cannot read {path}: {exc.reason}", help=exc.help) from None
    return decode(data, path)


def count_statements(statements) -> int:
    """`tensor` statements, loop bodies included (what the parser counted)."""
    n = 0
    for s in statements:
        if isinstance(s, ast.TensorDecl):
            n += 1
        elif isinstance(s, ast.ForLoop):
            n += count_statements(s.body)
    return n


def _real(source: Source) -> str:
    return os.path.realpath(source.path) if source.path != "<string>" else "<string>"


class Sources:
    """The files of one layout: those being elaborated (a stack), those read."""

    def __init__(self):
        self.stack: list[str] = []  # real paths, the top-level file first
        self.included: set[str] = set()
        self.read: list[Source] = []  # every text, in reading order
        self.tensor_statements = 0  # in the files parsed so far, loop bodies included

    @property
    def at_top_level(self) -> bool:
        """Is the file being elaborated the top-level one (not an include)?"""
        return len(self.stack) == 1

    def open(self, source: Source) -> list[ast.Stmt]:
        """Enter a file: its statements, parsed (until `close`, includes are relative to it)."""
        real = _real(source)
        self.stack.append(real)
        self.included.add(real)
        self.read.append(source)
        statements = list(parse_source(source, max_tensors=limits.MAX_TENSORS,
                                       tensors_before=self.tensor_statements, comments=False).statements)
        self.tensor_statements += count_statements(statements)
        return statements

    def close(self) -> None:
        self.stack.pop()

    def include(self, stmt: ast.Include, source: Source) -> Source | None:
        """The file `stmt` includes, read; None when the layout has taken it already."""
        if "\x00" in stmt.path:
            shown = stmt.path.replace("\x00", "\\x00")
            raise ElaborationError(f"cannot include \"{shown}\": a path cannot contain a NUL character", stmt.span,
                                   help="remove the NUL character from the path")
        base = os.path.dirname(source.path) if source.path != "<string>" else os.getcwd()
        path = os.path.normpath(os.path.join(base, stmt.path))
        real = os.path.realpath(path)
        if real in self.stack:
            chain = " -> ".join(os.path.basename(p) for p in self.stack + [real])
            raise ElaborationError(f"include cycle: {chain}", stmt.span,
                                   help="remove one of the includes; shared definitions belong in a third file")
        if real in self.included:
            return None  # already included: a file's definitions are taken once
        depth = len(self.stack)  # the top-level file is depth 0
        if depth > limits.MAX_INCLUDE_DEPTH:
            raise ElaborationError(f"include depth {depth} exceeds the limit of {limits.MAX_INCLUDE_DEPTH} "
                                   "nested includes", stmt.span,
                                   help="include shared files from one place instead of chaining them")
        try:
            data = read_layout_file(path)
        except FileRefused as exc:
            raise ElaborationError(f"cannot include \"{stmt.path}\": {exc.reason}", stmt.span,
                                   help=(f"{exc.help}; looked for {path}" if exc.help else
                                         f"the path is relative to this file: looked for {path}")) from None
        return decode(data, path)

    def digest(self, args: list[tuple[str, int]]) -> str:
        """sha256 of every text read, in order, and the args (their list's repr):
        equal digests, equal layouts."""
        return digest_of(self.read, args)


def digest_of(sources, args: list[tuple[str, int]]) -> str:
    """A layout's digest: sha256 of its texts, in the order read, and its args' list repr
    (layoutlang/checkpoint/layouts.py builds layouts without reading them: the same digest)."""
    h = hashlib.sha256()
    for source in sources:
        h.update(len(source.text).to_bytes(8, "little") + source.text.encode("utf-8"))
    h.update(repr(args).encode("utf-8"))
    return h.hexdigest()
