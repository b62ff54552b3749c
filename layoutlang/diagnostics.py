"""Diagnostics: one error root carrying file, line, column and a fix hint.

Every user-facing failure is a :class:`LayoutError`. It renders like a
compiler message so editors and humans can jump to it::

    train.layout:3:11: error: split 10 over tp=4 leaves remainder 2
        3 | tensor x [10 over tp]
          |           ^^^^^^^^^^
    help: use `pad 4` or change tp
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass, field
from typing import Iterable


@dataclass(frozen=True, eq=False)
class Source:
    """The text of one `.layout` file and the name it is reported under."""

    path: str
    text: str

    def line_text(self, line: int) -> str:
        lines = self.text.split("\n")
        return lines[line - 1] if 0 < line <= len(lines) else ""


@dataclass(frozen=True, slots=True)
class Span:
    """A region of a source: 1-based line and column, end exclusive.

    Slotted: every AST node holds one, so a million-line file holds millions.
    """

    source: Source = field(repr=False)
    line: int
    col: int
    end_line: int
    end_col: int

    @property
    def where(self) -> str:
        return f"{self.source.path}:{self.line}:{self.col}"


@dataclass(frozen=True)
class Note:
    """A secondary location that explains an error (the other declaration)."""

    message: str
    span: Span | None = None


class LayoutError(Exception):
    """The root of every error layoutlang reports to a user.

    `span` is where the problem is; `help` says what to do when a fix is
    known; `notes` point at related places (the first declaration of a
    duplicate, the loop that placed a tensor).
    """

    kind = "error"

    def __init__(self, message: str, span: Span | None = None, *,
                 help: str | None = None, notes: tuple[Note, ...] = ()):
        super().__init__(message)
        self.message = message
        self.span = span
        self.help = help
        self.notes = tuple(notes)

    @property
    def file(self) -> str | None:
        return self.span.source.path if self.span else None

    @property
    def line(self) -> int | None:
        return self.span.line if self.span else None

    @property
    def col(self) -> int | None:
        return self.span.col if self.span else None

    def render(self) -> str:
        return render(self)

    def __str__(self) -> str:
        return self.render()


class ParseError(LayoutError):
    """The text is not a `.layout` file (syntax, encoding, nesting)."""


class ElaborationError(LayoutError):
    """The file parses but means nothing consistent (names, sizes, splits)."""


class UsageError(LayoutError):
    """A command-line or API argument is wrong (not a file position)."""


def did_you_mean(name: str, options: Iterable[str]) -> str | None:
    """A help line naming the closest option, if one is close.

    >>> did_you_mean("fp8_e4m", ["bf16", "fp8_e4m3"])
    'did you mean `fp8_e4m3`?'
    """
    close = difflib.get_close_matches(name, list(options), n=1)
    return f"did you mean `{close[0]}`?" if close else None


def _snippet(span: Span) -> list[str]:
    text = "".join(ch if ch.isprintable() else " " for ch in span.source.line_text(span.line))
    if span.end_line == span.line:
        end_col = max(span.end_col, span.col + 1)
    else:
        end_col = len(text) + 1
    end_col = min(end_col, max(len(text) + 1, span.col + 1))
    width = len(str(span.line))
    gutter = " " * (width + 1)
    return [
        f"{span.line:>{width + 4}} | {text}",
        f"{gutter:>{width + 4}} | " + " " * (span.col - 1) + "^" * (end_col - span.col),
    ]


def render(error: LayoutError) -> str:
    """The full text of a diagnostic: header, source line, caret, notes, help."""
    lines = []
    head = f"{error.kind}: {error.message}"
    if error.span is not None:
        lines.append(f"{error.span.where}: {head}")
        lines.extend(_snippet(error.span))
    else:
        lines.append(head)
    for note in error.notes:
        if note.span is not None:
            lines.append(f"{note.span.where}: note: {note.message}")
            lines.extend(_snippet(note.span))
        else:
            lines.append(f"note: {note.message}")
    if error.help:
        lines.append(f"help: {error.help}")
    return "\n".join(lines)
