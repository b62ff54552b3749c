"""Building job groups leaves the process environment as it found it.

Gloo reads TORCH_GLOO_LAZY_INIT when a group is built, so layoutlang/runtime/jobgroups.py sets it for
the build alone. Threads of one process (in-process jobs, tests/test_jobs_args.py) build
groups at once: when one thread's build ended inside another's, the second put back the `1`
it had found and the variable outlived both. Every later gloo group of that process, and of
the processes it launched, then connected on first use, and a peer that held its first
message back stalled its receiver (CI: tests/test_land_early.py hung after test_jobs_args).
"""

import os
import threading
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from layoutlang.runtime.jobgroups import _lazy_gloo, build_group

VAR = "TORCH_GLOO_LAZY_INIT"


@pytest.fixture
def unset(monkeypatch):
    monkeypatch.delenv(VAR, raising=False)


def test_overlapping_builds_put_back_what_was_there(unset):
    """A enters, B enters, A leaves, B leaves: set while either is inside, unset after."""
    a_in, b_in, a_out = threading.Event(), threading.Event(), threading.Event()
    seen = {}

    def a():
        with _lazy_gloo():
            a_in.set()
            b_in.wait(5)
        a_out.set()

    def b():
        a_in.wait(5)
        with _lazy_gloo():
            b_in.set()
            a_out.wait(5)
            seen["b after a left"] = os.environ.get(VAR)

    threads = [threading.Thread(target=f) for f in (a, b)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert seen == {"b after a left": "1"}  # still lazy for the build that is still running
    assert VAR not in os.environ


def test_a_value_set_before_survives_overlapping_builds(monkeypatch):
    monkeypatch.setenv(VAR, "0")
    with _lazy_gloo():
        with _lazy_gloo():
            assert os.environ[VAR] == "1"
        assert os.environ[VAR] == "1"
    assert os.environ[VAR] == "0"


@pytest.mark.timeout(60)
def test_two_ranks_built_by_two_threads_leave_no_variable_behind(unset):
    """The real build, as in-process jobs run it: two threads are the two ranks of one group
    over one store; the group works (an all-reduce), and the variable is gone after."""
    store = dist.HashStore()
    sums = {}

    def rank(r):
        pg = build_group(store, "g", r, 2, torch.device("cpu"), timedelta(seconds=20))
        t = torch.tensor([r + 1.0])
        pg.allreduce([t]).wait()
        sums[r] = t.item()

    threads = [threading.Thread(target=rank, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(40)
    assert sums == {0: 3.0, 1: 3.0}
    assert VAR not in os.environ
