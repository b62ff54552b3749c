"""The one error a refit raises, and what it tells the caller to do next."""

from __future__ import annotations

import re

from layoutlang.diagnostics import LayoutError

REUSABLE = "nothing is left in flight: this Refitter can be used again (call refit on every rank)"
NOT_REUSABLE = ("destination tensors may be partly written and the process group may hold unfinished "
                "transfers: destroy and re-initialize the process group, then create a new Refitter")


class RefitError(LayoutError, RuntimeError):
    """A refit that could not start or did not complete.

    Rendered like every layoutlang error: ``error: rank R: step S, PHASE: what
    happened`` and a ``help:`` line saying whether this Refitter can be used
    again. Fields: ``rank`` (who raised), ``step``, ``phase`` ("setup",
    "agreement", "bucket 3", "verification"), ``peers`` (the ranks the problem
    points at), ``reusable``, ``detail`` (what happened, without the where).

    >>> print(RefitError.at(2, 7, "agreement", "rank 1 did not start step 7 within 2 s", peers=(1,), reusable=True))
    error: rank 2: step 7, agreement: rank 1 did not start step 7 within 2 s
    help: nothing is left in flight: this Refitter can be used again (call refit on every rank)
    """

    def __init__(self, message: str, *, rank: int | None = None, step: int | None = None,
                 phase: str = "", peers: tuple[int, ...] = (), reusable: bool = False,
                 detail: str | None = None, help: str | None = None):
        super().__init__(message, help=help)
        self.detail = message if detail is None else detail
        self.rank, self.step, self.phase, self.peers, self.reusable = rank, step, phase, tuple(peers), reusable

    @classmethod
    def at(cls, rank: int, step: int, phase: str, detail: str, *, peers=(), reusable: bool) -> "RefitError":
        """The standard form: where, what, and whether to reuse."""
        where = f"rank {rank}: step {step}, {phase}: " if step else f"rank {rank}: {phase}: "
        return cls(where + detail, rank=rank, step=step, phase=phase, peers=tuple(peers), reusable=reusable,
                   detail=detail, help=REUSABLE if reusable else NOT_REUSABLE)


def first_line(exc: BaseException) -> str:
    """The useful part of a torch/gloo error: its first line, without source paths and advice."""
    text = str(exc).strip()
    if not text:
        return type(exc).__name__
    line = re.sub(r"^\[[^\]]*\.(?:cc|cpp|h):\d+\]\s*", "", text.splitlines()[0])
    return line.split(". This is typically caused", 1)[0].rstrip(".")
