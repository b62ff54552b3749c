"""The store meetings alone, with threads as ranks (one TCPStore client each): no processes.

Properties: a meeting passes on every rank or fails on every rank with the
same reason; a missing rank is named; a late rank is told at once; a rank
that gives up releases the waiting ones at once, with its reason.
"""

import threading
import time
from datetime import timedelta

import pytest
import torch.distributed as dist

from layoutlang.runtime.rendezvous import Abandoned, Rendezvous, StoreUnreachable


@pytest.fixture
def stores():
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, timeout=timedelta(seconds=30), wait_for_workers=False)

    def client():
        return dist.TCPStore("127.0.0.1", server.port, is_master=False, timeout=timedelta(seconds=30))

    yield server, client


def _run_ranks(client, world, behaviour):
    """Run behaviour(rank, rendezvous) on `world` threads; collect (outcome, seconds) per rank."""
    out = {}

    def body(rank):
        rv = Rendezvous(client(), rank, world, "t")
        start = time.monotonic()
        try:
            behaviour(rank, rv)
            out[rank] = ("go", time.monotonic() - start)
        except Abandoned as exc:
            out[rank] = (exc.reason, exc.peers, time.monotonic() - start)

    threads = [threading.Thread(target=body, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    return out


@pytest.mark.timeout(60)
def test_everyone_arrives(stores):
    _, client = stores
    out = _run_ranks(client, 4, lambda r, rv: rv.meet("m", timedelta(seconds=5), what="start"))
    assert sorted(out) == [0, 1, 2, 3] and all(v[0] == "go" for v in out.values())


@pytest.mark.timeout(60)
def test_a_missing_rank_is_named_by_all_within_the_timeout(stores):
    _, client = stores

    def behaviour(rank, rv):
        if rank == 2:
            return  # never arrives
        rv.meet("m", timedelta(seconds=1), what="start step 5")

    out = _run_ranks(client, 4, behaviour)
    for rank in (0, 1, 3):
        reason, peers, seconds = out[rank]
        assert reason == "rank 2 did not start step 5 within 1 s (stalled or dead)"
        assert peers == (2,) and seconds < 2.0


@pytest.mark.timeout(60)
def test_a_late_rank_gets_the_same_reason_at_once(stores):
    _, client = stores

    def behaviour(rank, rv):
        if rank == 1:
            time.sleep(2.0)
        rv.meet("m", timedelta(seconds=0.5), what="start")

    out = _run_ranks(client, 3, behaviour)
    reasons = {out[r][0] for r in range(3)}
    assert reasons == {"rank 1 did not start within 0.5 s (stalled or dead)"}
    assert out[1][2] < 2.0 + 0.5  # after its 2 s sleep: told at once, no wait of its own


@pytest.mark.timeout(60)
def test_giving_up_releases_the_waiting_ranks_at_once_with_the_first_reason(stores):
    _, client = stores

    def behaviour(rank, rv):
        if rank == 0:
            time.sleep(0.3)
            rv.give_up("m", "rank 0 failed in bucket 4: boom", (3,))
            rv.give_up("m", "a later consequence", ())
            raise Abandoned("gave up")
        rv.meet("m", timedelta(seconds=20), what="finish bucket 4")

    out = _run_ranks(client, 3, behaviour)
    for rank in (1, 2):
        reason, peers, seconds = out[rank]
        assert (reason, peers) == ("rank 0 failed in bucket 4: boom", (3,))
        assert seconds < 5.0  # not the 20 s timeout


@pytest.mark.timeout(60)
def test_notes_are_read_after_a_meeting(stores):
    _, client = stores
    notes = {}

    def behaviour(rank, rv):
        rv.meet("m", timedelta(seconds=5), what="start", note=f"digest-{rank % 2}")
        notes[rank] = rv.notes("m")

    _run_ranks(client, 3, behaviour)
    assert notes == {r: ["digest-0", "digest-1", "digest-0"] for r in range(3)}


@pytest.mark.timeout(60)
def test_a_dead_store_is_its_own_error_naming_the_address():
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, timeout=timedelta(seconds=30), wait_for_workers=False)
    port = server.port
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=30))
    rv = Rendezvous(store, 0, 2, "t")
    del server  # the server goes away with its object
    with pytest.raises(StoreUnreachable) as info:
        rv.meet("m", timedelta(seconds=2), what="start")
    assert str(info.value).startswith(f"the process group's store at 127.0.0.1:{port} is unreachable (rank 0 hosts it")


@pytest.mark.timeout(60)
def test_every_rank_learns_how_many_ranks_set_each_mark(stores):
    _, client = stores
    # rank r marks (r is odd, r == 3): two odd ranks of five, one rank 3
    out = {}

    def behaviour(rank, rv):
        out[rank] = rv.meet("m", timedelta(seconds=5), what="start", marks=(rank % 2 == 1, rank == 3))

    _run_ranks(client, 5, behaviour)
    assert out == {r: (2, 1) for r in range(5)}


@pytest.mark.timeout(60)
def test_a_reused_seat_names_the_rank_that_sat_only_at_an_earlier_meeting(stores):
    """Seats are reused from meeting to meeting (no per-step keys); a rank that sat at meeting
    1 but never came to meeting 2 is still named missing at meeting 2."""
    _, client = stores

    def behaviour(rank, rv):
        rv.meet("m1", timedelta(seconds=5), what="start step 1", seat="seat/agree")
        if rank == 1:
            return
        rv.meet("m2", timedelta(seconds=1), what="start step 2", seat="seat/agree")

    out = _run_ranks(client, 3, behaviour)
    for rank in (0, 2):
        assert out[rank][:2] == ("rank 1 did not start step 2 within 1 s (stalled or dead)", (1,))


@pytest.mark.timeout(60)
def test_notes_come_from_reused_seats_without_the_meeting_tag(stores):
    _, client = stores
    notes = {}

    def behaviour(rank, rv):
        rv.meet("m1", timedelta(seconds=5), what="start", note="old", seat="seat/agree")
        rv.meet("m2", timedelta(seconds=5), what="start", note=f"n{rank}\nsecond line", seat="seat/agree")
        notes[rank] = rv.notes("m2", "seat/agree")

    _run_ranks(client, 2, behaviour)
    assert notes == {r: ["n0\nsecond line", "n1\nsecond line"] for r in range(2)}


def test_a_group_too_large_for_the_count_field_is_refused():
    with pytest.raises(ValueError, match="at most 65,535 ranks"):
        Rendezvous(None, 0, 65_536, "t")
