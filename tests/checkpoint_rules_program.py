"""One rank of tests/test_checkpoint_rules.py: a TP2 load both ways (each rank reading its own
slices; each key read once and exchanged), then a save of the loaded shards.

Run by `launch(job, 2, program=__file__)`; reports each destination as lists (JSON, no pickle)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from bridge_program import run  # tests/bridge_program.py: the frame of a launched program


def body(job: dict, rank: int) -> dict:
    from layoutlang import loads
    from layoutlang.checkpoint import load, save

    layout = loads(job["layout"])
    report = {}
    for mode in ("local", "exchange"):
        tensors = {t.name: torch.full(t.local_shape_at(rank), float("nan"),
                                      dtype=torch.float32 if t.dtype == "fp32" else torch.bfloat16)
                   for t in layout.tensors if t.holds(rank)}
        got = load(job["src"], layout, tensors, group=dist.group.WORLD, exchange=mode == "exchange")
        report[mode] = {k: v.float().tolist() for k, v in tensors.items()}
        if mode == "exchange":
            report["exchange_read"] = got.read_bytes
    report["written"] = save(job["out"], layout, tensors, group=dist.group.WORLD).written_bytes
    save(job["ranked_out"], layout, tensors, group=dist.group.WORLD, per_rank=True)
    # runs long enough to be written with pwrite: a column block (4 runs of 128 KiB) and a row block
    big = loads(job["big_layout"])
    cols = torch.arange(4 * 65536, dtype=torch.float32).reshape(4, 65536)
    rows = -torch.arange(256 * 512, dtype=torch.float32).reshape(256, 512)
    save(job["big_out"], big, {"cols": cols[:, 32768 * rank:32768 * (rank + 1)].clone(),
                               "rows": rows[128 * rank:128 * (rank + 1)].clone()}, group=dist.group.WORLD)
    # column-parallel keys with short runs: exchanged (their rows split over the writers)
    cp = loads(job["cp_layout"])
    full = {"wide": torch.arange(64 * 256).reshape(64, 256).to(torch.bfloat16),
            "odd": torch.arange(5 * 256).reshape(5, 256).to(torch.float32)}
    r = save(job["cp_out"], cp, {k: v[:, 128 * rank:128 * (rank + 1)].clone() for k, v in full.items()},
             group=dist.group.WORLD)
    report["cp_exchanged"] = list(r.exchanged)
    report["cp_transport"] = r.transport
    # the same save over the links (attach.py off), from strided views of the full tensors (not
    # contiguous: the blocks would be staged, so no rank reads another's memory), and with
    # rank 1 unable to read its peer's memory (every rank then takes the links)
    from layoutlang.checkpoint import exchange

    exchange.MEMORY = False
    try:
        r = save(job["cp_out"] + "_links", cp, {k: v[:, 128 * rank:128 * (rank + 1)].clone() for k, v in full.items()},
                 group=dist.group.WORLD)
    finally:
        exchange.MEMORY = True
    report["cp_links_transport"] = r.transport
    r = save(job["cp_out"] + "_strided", cp, {k: v[:, 128 * rank:128 * (rank + 1)] for k, v in full.items()},
             group=dist.group.WORLD)
    report["cp_strided_transport"] = r.transport
    from layoutlang.runtime import cma  # (attach.py's reads are cma.py's)

    readv = cma._READV
    if rank == 1:
        cma._READV = lambda *args: -1
    try:
        r = save(job["cp_out"] + "_refused", cp,
                 {k: v[:, 128 * rank:128 * (rank + 1)].clone() for k, v in full.items()}, group=dist.group.WORLD)
    finally:
        cma._READV = readv
    report["cp_refused_transport"] = r.transport
    # a stalled rank: the other raises within the save's timeout (its own group: a timed-out
    # gloo wait leaves the group unusable, and the frame still meets on the world afterwards)
    import time

    from layoutlang.runtime.errors import RefitError

    stalled = dist.new_group([0, 1])
    if rank == 1:
        time.sleep(4.0)
    start = time.monotonic()
    try:
        save(job["stall_out"], big, {"cols": cols[:, 32768 * rank:32768 * (rank + 1)].clone(),
                                     "rows": rows[128 * rank:128 * (rank + 1)].clone()}, group=stalled, timeout=1.0)
        report["stall"] = "saved"
    except RefitError as e:
        report["stall"] = str(e)
    report["stall_s"] = time.monotonic() - start
    return report


if __name__ == "__main__":
    run(body)
