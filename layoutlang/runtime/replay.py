"""Steady steps replayed: the tensor operations one walk of the steps made, run again.

In a steady step (`Refitter(steady=True)`, once one step passed everywhere) nothing a
walk of the steps decides can change while the caller passes the same tensors: the
schedule is fixed, the staging arenas (layoutlang/runtime/staging.py) hand out the same buffers in
the same order, and so every view, buffer and message is the same as last step's. Only
the Python that finds them is spent again, per op, on every rank: on a busy host that is
most of what a step costs above a hand-written exchange of the same messages
(benchmarks/refit_gloo.py). So a steady step records what its walk does to tensors
(copies, zeroed padding, each round's messages posted, its waits) and later steps run the
record while the tensors are the same: per op, nothing but the call itself.

A record is made only where its replay is the walk: every step of this rank is one of
`REPLAYABLE` (no quantizing or dequantizing, which allocate per step and depend on
values), staging is kept (an arena; fresh buffers would be held between steps) or the
rank stages nothing (`stages`: its record then holds no buffer of its own, which is what
lets an accelerator, where arenas are not kept by default, replay its contiguous
transfers), the hooks do not see buckets or sends, and the tensors of the recorded step
are those of the step before it. A record is valid for the memory of the tensors it was made with
(`tensor_key`): it holds views of them, so while it lives no other tensor can have their
address; any other tensor drops it and the step is walked (and recorded again once the
tensors stay put). A replayed step skips the steady step's tensor check too: the same
names, memory, dtypes, shapes and strides as the recorded step, which passed it, pass it.
`Refitter.release_staging()` drops the record with the arenas.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.overrides import has_torch_function

from layoutlang.compiler.steps import Schedule

# step kinds whose effects are the same tensor operations on the same memory every step
REPLAYABLE = frozenset({"zero", "send", "recv", "post", "wait", "copy", "land"})


def replayable(schedule: Schedule) -> bool:
    """Is every step this rank walks one whose replay is the walk?"""
    return all(st.kind in REPLAYABLE for steps in schedule.steps for st in steps)


def stages(schedule: Schedule) -> bool:
    """Does this rank carve any staging buffer (a send or receive through a buffer; a land
    is a staged receive's)? A replayable step that stages none only touches the caller's
    tensors."""
    return any(st.staged for steps in schedule.steps for st in steps)


def resolved_posts(messages: list, coalesces: bool) -> list | None:
    """A round's messages as the process-group calls that `dist.isend` / `dist.irecv` end in,
    resolved once at record time: `(group.send or group.recv, [tensor], the peer's rank in
    the group, tag)` each. Per message those wrappers find the group, translate the peer's
    rank and check the tensor; nothing they look at can change while a record is valid (the
    same tensors, group and peers), so a replay posts what a hand-written exchange of the
    same messages posts, without that Python (benchmarks/README.md: on a loaded host it was
    most of a replayed step's cost above the hand exchange's, with the waits' timedeltas).

    None where a round does not take that path: a backend that groups messages (NCCL gets
    `batch_isend_irecv`), a tensor whose `__torch_function__` would see the call (a DTensor;
    a Parameter has none), a complex tensor (sent as its real view).
    """
    if coalesces:
        return None
    calls = []
    for p in messages:
        t = p.tensor
        if has_torch_function((t,)) or t.is_complex() or p.op not in (dist.isend, dist.irecv):
            return None
        group = p.group if p.group is not None else dist.distributed_c10d._get_default_group()
        call = group.send if p.op is dist.isend else group.recv
        calls.append((call, [t], dist.get_group_rank(group, p.peer), p.tag))
    return calls


def tensor_key(src: dict, dst: dict) -> tuple | None:
    """The memory of every tensor a caller passed (None if one is not a plain tensor)."""
    key: list = []
    for side in (src, dst):
        for name, v in side.items():
            if not isinstance(v, torch.Tensor):
                return None
            key.append((name, v.data_ptr(), v.dtype, tuple(v.shape), v.stride(), v.device))
        key.append(None)  # (a name on the other side is another tensor)
    return tuple(key)


@dataclass
class Recording:
    """One walked step's actions, each `(kind, a, b)`:

    - ("phase", name, None): the step's phase from here on (what an error names);
    - ("zero", view, None) and ("copy", target, source): views of the caller's tensors or of
      staging buffers, never a tensor made while recording (a caller changes its tensors in
      place: a copy made then would replay its values), `target` and `source` of one shape
      (`views.aligned`);
    - ("reshape", target, source): a copy whose ends have no view in one shape: the source
      is reshaped (copied) anew at every replay;
    - ("post", n, (messages, what, calls)): post a round's point-to-point messages, as works
      `n` (through `calls`, their `resolved_posts`, where there are some);
    - ("wait", n, (which, ops, what)): wait for these of works `n` (indices: a staged receive
      waits for its own message before it lands, the round's wait for the rest) under the
      deadline their post set.

    With what the walk added to the Refitter's counters and its staging meter.
    """

    key: tuple
    actions: list
    sent_bytes: int
    received_bytes: int
    local_bytes: int
    staged_ahead: int
    peak: int
    per_bucket_peak: tuple[int, ...]
