"""The "memory" transport (layoutlang/runtime/transport_memory.py): the runtime's suite on it.

Every refit here runs in local worker processes (`layoutlang.runtime.worker.run`: the layouts'
fill from logical coordinates, every destination element checked against
layoutlang/runtime/fill.py's expectation, written from the layouts, not from the runtime)
with `transport="memory"`, each channel read with `process_vm_readv` ("cma") or forced
through a shared-memory ring ("ring"). The fault-free cases share one launch of 8 ranks
(tests/shared_launch.py); the fault table runs tests/test_runtime_faults.py's pair and
faults on it. The channel layer (`MemoryLinks`) is also checked on its own, in one process
pair: order, sizes, a FIFO and a ring smaller than what is posted at once.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
import torch

from layoutlang.compiler import compile_plan
from layoutlang.diagnostics import UsageError
from layoutlang.runtime import cma, memlinks
from layoutlang.runtime.launch import launch
from layoutlang.runtime.transport import transport_class
from layoutlang.runtime.transport_memory import MemoryTransport
from shared_launch import launch_cases
from test_replay import REPLICAS, TRAIN as RELAY_TRAIN
from test_runtime import INFER, TRAIN
from test_runtime import _destination_bytes as destination_bytes  # (from the layouts and the wire rule)
from test_runtime_faults import DST as FAULT_DST, NPROC as FAULT_NPROC, SLACK, SRC as FAULT_SRC, TIMEOUT

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SMALL = os.path.join(ROOT, "examples", "small")
NPROC = 8
RING = {"mode": "ring", "ring_bytes": 4096}  # a ring smaller than most messages: chunks wrap around it


def _small(name: str) -> str:
    return os.path.join(SMALL, f"{name}.layout")


@pytest.fixture(scope="module")
def suite(tmp_path_factory):
    """Every fault-free case, on "memory" and on "memory" forced to rings, in one launch."""
    d = tmp_path_factory.mktemp("memory")
    for name, text in (("train", TRAIN), ("infer", INFER), ("relay_train", RELAY_TRAIN), ("replicas", REPLICAS)):
        (d / f"{name}.layout").write_text(text)
    quant = {"src": str(d / "train.layout"), "dst": str(d / "infer.layout")}  # mxfp8, fp8_e4m3, fp16, padding, gtp
    relays = {"src": str(d / "relay_train.layout"), "dst": str(d / "replicas.layout")}
    llama = {"src": _small("llama_train"), "dst": _small("llama_infer")}
    moe = {"src": _small("moe_train"), "dst": _small("moe_infer")}
    v2 = {"src": _small("v2/llama_megatron"), "dst": _small("v2/llama_vllm")}
    cases = []
    for kind, options in (("cma", None), ("ring", RING)):
        on = {"transport": "memory", **({"transport_options": options} if options else {})}
        cases += [(f"{kind}-quantized-buckets", {**quant, **on, "verify": True, "budget": 1024, "steps": 2}),
                  (f"{kind}-strided", {**quant, **on, "verify": True, "budget": 1024, "strided": True}),
                  (f"{kind}-overlap", {**quant, **on, "budget": 1024, "steps": 3, "overlap": True}),
                  (f"{kind}-steady-relays", {**relays, **on, "steady": True, "alternate": True, "steps": 5}),
                  (f"{kind}-llama", {**llama, **on, "verify": True})]
    cases += [("cma-moe", {**moe, "transport": "memory", "verify": True}),
              ("cma-v2-mxfp8", {**v2, "transport": "memory", "verify": True, "steady": True, "steps": 3})]
    out = launch_cases(cases, NPROC, timeout=240)
    out["plans"] = {"quant": compile_plan(quant["src"], quant["dst"]), "relays": compile_plan(relays["src"], relays["dst"])}
    out["paths"] = {"quant": (quant["src"], quant["dst"])}
    return out


def _ok(results, name):
    assert results is not None, f"the launch did not reach `{name}`"
    for r in results:
        assert r.ok, f"{name}: rank {r.rank}: {r.error} {r.result and r.result.get('check_errors')} {r.stderr[-800:]}"


@pytest.mark.timeout(300)
@pytest.mark.parametrize("kind", ["cma", "ring"])
def test_every_case_is_exact_on_the_memory_transport(suite, kind):
    names = [n for n in suite if n.startswith(kind + "-") and n not in ("plans", "paths")]
    assert len(names) >= 5
    for name in names:
        _ok(suite[name], name)
        modes = {r.result["transport_mode"] for r in suite[name] if r.result["sent_bytes"] + r.result["received_bytes"]}
        # where Yama's policy is 0 or 1 (a rank allows its readers) siblings may read each other
        assert modes == ({kind} if kind == "ring" or cma.ptrace_scope() in (None, 0, 1) else {"ring"}), (name, modes)
    # the quantized pair: every destination element once per step (the bytes of the wire rule)
    assert any(op.wire for op in suite["plans"]["quant"].ops)  # mxfp8 blocks on the wire
    quantized = suite[f"{kind}-quantized-buckets"]
    assert sum(r.result["received_bytes"] + r.result["local_bytes"] for r in quantized) == destination_bytes(
        *suite["paths"]["quant"])
    # relays forward what they received; steady steps 3-5 replay step 2's record, sources rewritten in place
    assert any(op.after for op in suite["plans"]["relays"].ops)
    steady = suite[f"{kind}-steady-relays"]
    assert all(r.result["replayed"] == 3 for r in steady if r.result["checked_tensors"]), [
        r.result["replayed"] for r in steady]
    assert sum(r.result["staged_ahead"] for r in suite[f"{kind}-overlap"]) > 0


def test_the_registry_builds_it_and_the_mode_is_checked():
    assert transport_class("memory") is MemoryTransport
    with pytest.raises(UsageError) as err:
        MemoryTransport(mode="fast")
    assert str(err.value).splitlines() == [
        "error: memory transport mode 'fast': known are \"cma\" and \"ring\"",
        "help: leave it out (and LAYOUTLANG_MEMORY_MODE unset) for the best each pair of ranks can"]
    assert MemoryTransport(mode="ring").mode is None  # (nothing connected yet)


@pytest.fixture
def fault_pair(tmp_path):
    (tmp_path / "src.layout").write_text(FAULT_SRC)
    (tmp_path / "dst.layout").write_text(FAULT_DST)
    return {"src": str(tmp_path / "src.layout"), "dst": str(tmp_path / "dst.layout"), "timeout": TIMEOUT,
            "pg_timeout": 300, "budget": 600, "transport": "memory"}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("fault", ["killed", "stalled"])
def test_a_peer_killed_or_stalled_mid_bucket_is_named_by_every_survivor_in_time(fault_pair, fault):
    """tests/test_runtime_faults.py's pair (every rank sends in bucket 1) on "memory": rank 1 is
    SIGKILLed, or sleeps, as bucket 1 starts, while the others have posted theirs. Every
    survivor fails step 1 in bucket 1 within timeout + 1 s naming rank 1: a killed one at once
    by its process's exit (each survivor sends to rank 1, a destination rank), a stalled one
    by the deadline; and the Refitter says at once that it cannot be reused."""
    fault_job = {"die": {"rank": 1, "bucket": 1, "after": 0.3, "kill": True}} if fault == "killed" else {
        "stall": {"rank": 1, "bucket": 1, "seconds": 4}}
    results = launch({**fault_pair, "retry": True, **fault_job}, FAULT_NPROC, timeout=90)
    if fault == "killed":
        assert results[1].returncode == -9
    for r in results:
        if r.rank == 1:
            continue
        first, again = r.result["outcomes"]
        assert first["seconds"] <= TIMEOUT + SLACK, first
        assert first["error"].startswith(f"error: rank {r.rank}: step 1, bucket 1: "), first
        assert first["peers"] == [1] and first["reusable"] is False, first
        if fault == "killed":
            assert re.search(r"peer rank 1 died \(process \d+ exited\)", first["error"]), first
        else:
            assert "peer rank 1 did not complete it within 2 s" in first["error"], first
        assert again["error"].startswith(f"error: rank {r.rank}: step 2, setup: this Refitter cannot be reused: "
                                         "step 1 failed in bucket 1: "), again


@pytest.mark.timeout(120)
def test_a_rank_that_never_arrives_is_named_by_everyone_in_time(fault_pair):
    results = launch({**fault_pair, "stall_before": {"rank": 2, "seconds": 3}, "linger": 4}, FAULT_NPROC, timeout=90)
    for r in results:
        if r.rank == 2:
            continue
        first = r.result["outcomes"][0]
        assert first["error"].startswith(f"error: rank {r.rank}: step 1, agreement: rank 2 did not start step 1 "
                                         "within 2 s"), first
        assert first["peers"] == [2] and first["seconds"] <= TIMEOUT + SLACK, first


def _pair(mode, ring_bytes=memlinks.RING_BYTES, timeout=20.0):
    """Two MemoryLinks of this process (ranks 0 and 1), connected through a HashStore in two threads."""
    import threading
    import time

    store = torch.distributed.HashStore()
    links = [memlinks.MemoryLinks(store, "test", me, [1 - me], mode=mode, ring_bytes=ring_bytes) for me in (0, 1)]
    errors = []

    def connect(link):
        try:
            link.connect(time.monotonic() + timeout)
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=connect, args=(link,)) for link in links]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    return links


def _exchange(links, sizes, timeout=20.0):
    """Rank 0 sends messages of `sizes` bytes to rank 1, and rank 1 the same sizes back, all posted
    at once; each side waits in its own thread. Returns what each side received."""
    import threading
    import time

    gen = torch.Generator().manual_seed(len(sizes))
    sent = [[torch.randint(0, 256, (n,), dtype=torch.uint8, generator=gen) for n in sizes] for _ in links]
    got = [[torch.zeros(n, dtype=torch.uint8) for n in sizes] for _ in links]
    errors = []

    def run(me):
        try:
            msgs = [memlinks.Message(True, t, 1 - me) for t in sent[me]] + [
                memlinks.Message(False, t, 1 - me) for t in got[me]]
            works = links[me].post(msgs)
            links[me].wait(works, time.monotonic() + timeout)
        except Exception as exc:  # noqa: BLE001
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(me,)) for me in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    return sent, got


def _files_of_this_process():
    head = f"{memlinks.PREFIX}{memlinks._pid_namespace()}-{os.getpid()}-"
    return [n for n in os.listdir(memlinks.shm_dir()) if n.startswith(head)]


@pytest.mark.parametrize("mode", [None, "ring"])
def test_links_deliver_every_message_in_order_past_a_full_fifo_and_a_small_ring(mode):
    """More messages than a channel has slots, posted at once both ways (each side's posts queue),
    of sizes that cut a 1000-byte ring's chunks at every offset; zero-byte messages too. Each
    receiver gets exactly the bytes its peer sent, message by message."""
    links = _pair(mode, ring_bytes=1000)
    try:
        assert _files_of_this_process() == []  # unlinked once both ends mapped them
        kinds = {"ring"} if mode == "ring" else {"cma"}
        assert set(links[0].modes.values()) == kinds and set(links[1].modes.values()) == kinds
        sizes = [(37 * i) % 1500 for i in range(memlinks.SLOTS + 40)]
        sent, got = _exchange(links, sizes)
        for me in (0, 1):
            assert all(torch.equal(a, b) for a, b in zip(sent[1 - me], got[me]))
    finally:
        for link in links:
            link.close()


def test_a_size_mismatch_and_a_missing_message_are_named():
    import time

    links = _pair(None)
    try:
        links[0].post([memlinks.Message(True, torch.zeros(8, dtype=torch.uint8), 1)])
        works = links[1].post([memlinks.Message(False, torch.zeros(4, dtype=torch.uint8), 0)])
        with pytest.raises(memlinks.LinkError) as err:
            links[1].wait(works, time.monotonic() + 5)
        assert err.value.peer == 0 and err.value.index == 0
        assert err.value.reason == "rank 0 sent 8 bytes where this rank expects 4 (message 0; the ranks posted " \
                                   "different messages)"
        late = links[0].post([memlinks.Message(False, torch.zeros(4, dtype=torch.uint8), 1)])
        with pytest.raises(memlinks.LinkError) as err:
            links[0].wait(late, time.monotonic() + 0.05)
        assert (err.value.peer, err.value.index, err.value.timed_out) == (1, 0, True)
    finally:
        for link in links:
            link.close()


def test_stale_channel_files_of_dead_processes_are_removed():
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    ns = memlinks._pid_namespace()
    stale = os.path.join(memlinks.shm_dir(), f"{memlinks.PREFIX}{ns}-{dead.pid}-test")
    live = os.path.join(memlinks.shm_dir(), f"{memlinks.PREFIX}{ns}-{os.getpid()}-test")
    for path in (stale, live):
        open(path, "w").close()
    try:
        memlinks.clean_stale(ns)
        assert not os.path.exists(stale) and os.path.exists(live)
    finally:
        for path in (stale, live):
            if os.path.exists(path):
                os.unlink(path)


@pytest.mark.timeout(120)
def test_a_peer_killed_in_a_replayed_steady_step_is_named_by_its_receivers(fault_pair):
    """`steady=True` on "memory": step 1 meets, step 2 is walked and recorded, step 3 replays the
    record (no meeting at all); rank 2, a sender only, dies as step 3 starts. Ranks 0 and 1
    receive from it: each fails step 3 within the timeout naming rank 2."""
    results = launch({**fault_pair, "steps": 4, "retry": True, "steady": True,
                      "die_before": {"rank": 2, "step": 3, "after": 0.5}}, FAULT_NPROC, timeout=90)
    assert results[2].returncode == 3
    for r in results[:2]:
        *ok, failed, again = r.result["outcomes"]
        assert len(ok) == 2 and all(o["error"] is None for o in ok), ok
        assert failed["error"].startswith(f"error: rank {r.rank}: step 3, bucket "), failed
        assert "peer rank 2" in failed["error"] and failed["peers"] == [2], failed
        assert failed["seconds"] <= 0.5 + TIMEOUT + SLACK, failed
        assert r.result["replayed"] == 1  # step 3 ran from step 2's record


def test_a_peer_on_another_host_or_unreadable_is_refused_naming_it():
    """Rank 1's record in the store, written by hand: another boot id is another host; a pid
    that is not the publisher (an exited process) cannot be read, which "cma" refuses and the
    default takes a ring for."""
    import time

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    ns = memlinks._pid_namespace()
    store = torch.distributed.HashStore()
    store.set("far/who/1", f"{os.getpid()} 0 0 another-boot {ns} far-away")
    with pytest.raises(memlinks.LinkError) as err:
        memlinks.MemoryLinks(store, "far", 0, [1]).connect(time.monotonic() + 5)
    assert err.value.peer == 1
    assert err.value.reason.startswith("rank 1 runs on another host (far-away, this rank on ")
    store.set("gone/who/1", f"{dead.pid} 4096 7 {memlinks._boot_id()} {ns} here")
    with pytest.raises(memlinks.LinkError) as err:
        memlinks.MemoryLinks(store, "gone", 0, [1], mode="cma").connect(time.monotonic() + 5)
    assert err.value.peer == 1 and err.value.reason.startswith(
        f"this rank cannot read process {dead.pid} of rank 1 with process_vm_readv")
    links = memlinks.MemoryLinks(store, "gone", 0, [1])
    with pytest.raises(memlinks.LinkError) as err:  # (a ring for rank 1; nobody maps this rank's channel)
        links.connect(time.monotonic() + 0.2)
    assert err.value.peer == 1 and err.value.timed_out
    assert _files_of_this_process() == []  # a failed connect leaves no file


def test_sever_fails_the_other_ends_pending_and_later_messages_at_once():
    """Rank 1 waits for a message rank 0 never sends; rank 0 severs its links: rank 1's wait fails
    at once naming rank 0 (a 20 s deadline never comes near), and so does a later receive and a
    send rank 1 posts to it. What was done before the sever stays done; rank 0 posts no more."""
    import time

    links = _pair(None)
    try:
        _exchange(links, [64, 0, 3000])  # done both ways before the sever: no error from them later
        pending = links[1].post([memlinks.Message(False, torch.zeros(16, dtype=torch.uint8), 0)])
        links[0].sever()
        began = time.monotonic()
        with pytest.raises(memlinks.LinkError) as err:
            links[1].wait(pending, time.monotonic() + 20)
        assert time.monotonic() - began < 2.0
        assert (err.value.peer, err.value.index, err.value.closed) == (0, 0, True)
        assert err.value.reason == "rank 0 closed the link"
        with pytest.raises(memlinks.LinkError) as err:
            links[0].post([memlinks.Message(True, torch.ones(8, dtype=torch.uint8), 1)])
        assert err.value.reason == "this rank closed its link with rank 1"
        assert not links[0].pending()
    finally:
        for link in links:
            link.close()
    links = _pair(None)  # a send posted after its receiver severed, nothing else pending
    try:
        links[0].sever()
        later = links[1].post([memlinks.Message(True, torch.ones(8, dtype=torch.uint8), 0)])
        with pytest.raises(memlinks.LinkError) as err:
            links[1].wait(later, time.monotonic() + 20)
        assert err.value.reason == "rank 0 closed the link" and err.value.index == 0
    finally:
        for link in links:
            link.close()


def test_wait_all_moves_the_other_links_while_it_waits_on_one():
    """Rank 0 is linked to ranks 1 and 2 by two MemoryLinks (one per replica, as a trainer rank
    is). It posts more messages to rank 2 than a channel has slots (the rest queue in rank 0's
    process) and waits on a message from rank 1, which rank 1 sends only once rank 2 got all of
    its own: the wait completes only if it moves rank 2's channel too (`also`)."""
    import threading
    import time

    store = torch.distributed.HashStore()
    a = [memlinks.MemoryLinks(store, "a", me, [1 - me]) for me in (0, 1)]
    b = [memlinks.MemoryLinks(store, "b", me, [2 - me]) for me in (0, 2)]  # rank 0 and rank 2
    threads = [threading.Thread(target=link.connect, args=(time.monotonic() + 20,)) for link in a + b]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    count = memlinks.SLOTS + 20
    sent = [torch.full((8,), i % 251, dtype=torch.uint8) for i in range(count)]
    got = [torch.zeros(8, dtype=torch.uint8) for _ in range(count)]
    answer, errors = torch.zeros(4, dtype=torch.uint8), []

    def rank2_then_rank1():
        try:
            b[1].wait(b[1].post([memlinks.Message(False, t, 0) for t in got]), time.monotonic() + 20)
            a[1].wait(a[1].post([memlinks.Message(True, torch.full((4,), 7, dtype=torch.uint8), 0)]),
                      time.monotonic() + 20)
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    try:
        b[0].post([memlinks.Message(True, t, 2) for t in sent])
        other = threading.Thread(target=rank2_then_rank1)
        other.start()
        works = a[0].post([memlinks.Message(False, answer, 1)])
        memlinks.wait_all([(a[0], w) for w in works], time.monotonic() + 5, also=[b[0]])
        other.join(20)
        assert not errors, errors
        assert answer.tolist() == [7] * 4 and all(torch.equal(x, y) for x, y in zip(sent, got))
    finally:
        for link in a + b:
            link.close()


def test_a_watched_peer_whose_process_is_stopped_fails_the_wait_naming_it():
    """`watch_stopped`: rank 0's peer, as its links know it, is a process stopped with SIGSTOP
    (a child of this test standing in for rank 1's process); a receive from it fails within
    the watch's 0.1 s (well before the 20 s deadline), naming it; unwatched, it would wait."""
    import signal
    import time

    links = _pair(None)
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        os.kill(child.pid, signal.SIGSTOP)
        links[0].pids[1] = child.pid
        links[0].procs.watch_stopped = 0.1
        works = links[0].post([memlinks.Message(False, torch.zeros(4, dtype=torch.uint8), 1)])
        began = time.monotonic()
        with pytest.raises(memlinks.LinkError) as err:
            links[0].wait(works, time.monotonic() + 20)
        assert time.monotonic() - began < 2.0
        assert err.value.peer == 1 and err.value.index == 0 and not err.value.timed_out
        assert err.value.reason.startswith(f"peer rank 1 is stopped (process {child.pid} stopped for ")
    finally:
        child.kill()
        child.wait()
        for link in links:
            link.close()
