"""The "group" transport: a torch.distributed process group, gloo and NCCL one code path.

Each message is a `dist.P2POp` to the peer's global rank. A backend that coalesces
point-to-point messages (NCCL) gets a round as one `batch_isend_irecv` group (deadlock-free
whatever order peers post in); one that cannot (gloo) gets each message posted at once,
which is all `batch_isend_irecv` does there, less its per-message checks. Ranks meet in the
default group's store (layoutlang/runtime/rendezvous.py), under the group's members.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from .errors import first_line
from .replay import resolved_posts
from .transport import Transport

CAUSE_GRACE = 0.5  # s a rank whose transfer broke looks for the reason of a rank that failed first


def _group_rank(global_rank: int, group) -> int | None:
    """A message's peer (a global rank, as P2POp holds it) as a rank of the plan (its group's)."""
    if group is None:
        return global_rank
    try:
        return dist.get_group_rank(group, global_rank)
    except Exception:  # noqa: BLE001 - unknown: the error names no peer
        return None


def _default_store():
    """The default process group's store (where ranks meet), if any."""
    try:
        from torch.distributed import distributed_c10d
        return distributed_c10d._get_default_store()
    except Exception:  # noqa: BLE001 - reported by the caller
        return None


class GroupTransport(Transport):
    """A Refitter's messages through `group` (None: the default group)."""

    name = "group"

    def __init__(self, group=None):
        self.group = group
        self.coalescing: dict[torch.device, bool] = {}  # device -> backend groups messages (`post`)

    def place(self) -> tuple[int, int]:
        return dist.get_rank(self.group), dist.get_world_size(self.group)

    def meeting(self):
        ranks = list(dist.get_process_group_ranks(self.group) if self.group is not None
                     else range(dist.get_world_size()))
        return _default_store(), ranks

    def device(self) -> torch.device:
        if dist.get_backend(self.group) == "nccl":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    def carrier(self, peer: int) -> str:
        try:
            return f"group ({dist.get_backend(self.group)})"
        except Exception:  # noqa: BLE001 - a group already destroyed
            return "group"

    def _peer(self, rank: int) -> int:
        return dist.get_global_rank(self.group, rank) if self.group is not None else rank

    def message(self, sending: bool, buf: torch.Tensor, rank: int):
        return dist.P2POp(dist.isend if sending else dist.irecv, buf, self._peer(rank), self.group)

    def coalesces(self, device: torch.device) -> bool:
        """Does the group's backend for `device` group point-to-point messages (NCCL does)?"""
        if device not in self.coalescing:
            try:
                group = self.group if self.group is not None else dist.distributed_c10d._get_default_group()
                self.coalescing[device] = bool(group._get_backend(device).supports_coalescing)
            except Exception:  # noqa: BLE001 - unknown: group them, as torch would
                self.coalescing[device] = True
        return self.coalescing[device]

    def resolved(self, messages: list) -> list | None:
        return resolved_posts(messages, self.coalesces(messages[0].tensor.device))

    def post(self, messages: list, what: str, calls: list | None = None) -> list:
        """A round's messages, one work each (NCCL: one group, `batch_isend_irecv`); a replay
        passes the process-group calls they resolved to once (`replay.resolved_posts`)."""
        if not messages:
            return []
        posting = None  # the message being posted one at a time when a post fails: its peer is named
        try:
            if calls is not None:
                return [call(tensors, peer, tag) for call, tensors, peer, tag in calls]
            if self.coalesces(messages[0].tensor.device):
                return dist.batch_isend_irecv(messages)
            works = []
            for posting in messages:
                works.append(posting.op(posting.tensor, posting.peer, posting.group, posting.tag))
            return works
        except Exception as exc:  # noqa: BLE001
            # a peer that died closes its connections: a post to it fails before any wait does, and
            # the reason to report is the one a rank that failed first gave, else that peer
            peer = None if posting is None else _group_rank(posting.peer, posting.group)
            at = "" if peer is None else f" at the one with peer rank {peer}"
            raise self.host.failure(f"posting {len(messages)} {what} failed{at}: {first_line(exc)}",
                                    peers=() if peer is None else (peer,), grace=CAUSE_GRACE) from exc

    def wait(self, works: list, ops: list, what: str, deadline: float | None = None) -> None:
        """Wait under ONE deadline (not one timeout per transfer): from now, or the one their
        round got when it was posted (a round waited for in parts).

        `Work.wait` takes the time left as float seconds (its binding reads a float as seconds,
        as it reads a timedelta): building a timedelta per message cost a steady step on a
        busy host about 10 us a message (benchmarks/README.md)."""
        host = self.host
        timeout = host.timeout.total_seconds()
        if deadline is None:
            deadline = time.monotonic() + timeout
        for work, op in zip(works, ops):
            left = deadline - time.monotonic()
            try:
                ok = work.wait(left if left > 0.001 else 0.001)
            except Exception as exc:  # noqa: BLE001 - every transport error becomes one message
                peer = op.dst_rank if op.src_rank == host.rank else op.src_rank
                text = first_line(exc)
                timed_out = "timed out" in text.lower() or "timeout" in text.lower()
                if timed_out:
                    text = f"peer rank {peer} did not complete it within {timeout:g} s"
                raise host.failure(f"{what} of op {op.id} (`{op.key}`) with peer rank {peer} failed: {text}",
                                   peers=(peer,), grace=0.0 if timed_out else CAUSE_GRACE) from exc
            if ok is False:
                peer = op.dst_rank if op.src_rank == host.rank else op.src_rank
                raise host.failure(f"peer rank {peer} did not complete {what} of op {op.id} (`{op.key}`) "
                                   f"within {timeout:g} s", peers=(peer,))
