"""The one error a refit raises, and what it tells the caller to do next."""

from __future__ import annotations

REUSABLE = "Nothing is left in flight: this Refitter can be used again (call refit on every rank)."
NOT_REUSABLE = ("Destination tensors may be partly written and the process group may hold unfinished "
                "transfers: destroy and re-initialize the process group, then create a new Refitter.")


class RefitError(RuntimeError):
    """A refit that could not start or did not complete.

    The message starts with ``rank R: step S, PHASE:`` and ends with whether
    this Refitter can be used again. Fields: ``rank`` (who raised), ``step``,
    ``phase`` ("setup", "agreement", "bucket 3", "verification"), ``peers``
    (the ranks the problem points at), ``reusable``.
    """

    def __init__(self, message: str, *, rank: int | None = None, step: int | None = None,
                 phase: str = "", peers: tuple[int, ...] = (), reusable: bool = False,
                 detail: str | None = None):
        self.detail = message if detail is None else detail
        self.rank, self.step, self.phase, self.peers, self.reusable = rank, step, phase, tuple(peers), reusable
        super().__init__(message)

    @classmethod
    def at(cls, rank: int, step: int, phase: str, detail: str, *, peers=(), reusable: bool) -> "RefitError":
        """The standard form: where, what, and whether to reuse."""
        where = f"rank {rank}: step {step}, {phase}: " if step else f"rank {rank}: {phase}: "
        return cls(f"{where}{detail}. {REUSABLE if reusable else NOT_REUSABLE}", rank=rank, step=step,
                   phase=phase, peers=tuple(peers), reusable=reusable, detail=detail)
