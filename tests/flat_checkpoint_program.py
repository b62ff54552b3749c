"""The gloo ranks of tests/test_flat.py's checkpoint case: `checkpoint.save` from flat shards
(FSDP1-style unit with alignment, a ZeRO-3-style key) and `checkpoint.load` back into them.

Run by `layoutlang.runtime.launch.launch(job, 2, program=__file__)` as
`python flat_checkpoint_program.py JOB.json OUT.json`: each rank fills its flat shards by the
fill rule (value by key and row-major index in the key), saves, then loads the files into NaN
shards (their padding 7.0) and compares every data element with what it had; the padding of a
flat dim must come back untouched (docs/language.md 14.9: a refit never writes it). The
parent compares the files with the fill rule applied to one whole tensor per key.
"""

from __future__ import annotations

import datetime
import json
import os
import sys
import traceback

import torch
import torch.distributed as dist

from layoutlang import checkpoint, loads
from layoutlang.runtime.fill import key_values, source_tensor


def main(job_path: str, out_path: str) -> None:
    job = json.loads(open(job_path).read())
    rank = int(os.environ["RANK"])
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    try:
        layout = loads(job["text"], "flat.layout")
        mine = {t.name: source_tensor(t, rank) for t in layout.tensors if t.holds(rank)}
        checkpoint.save(job["dir"], layout, mine, group=dist.group.WORLD)
        dist.barrier()
        data = {t.name: key_values(t, rank)[1] for t in layout.tensors}
        back = {n: torch.where(data[n], float("nan"), 7.0) for n in mine}
        checkpoint.load(job["dir"], layout, back, rank=rank)
        for t in layout.tensors:
            mask = data[t.name]
            assert torch.equal(back[t.name][mask], mine[t.name][mask]), f"{t.name}: loaded data differ"
            assert bool((back[t.name][~mask] == 7.0).all()), f"{t.name}: padding written by the load"
        result = {"ok": True, "rank": rank}
    except Exception:  # noqa: BLE001 - the parent shows it
        result = {"ok": False, "rank": rank, "error": traceback.format_exc()}
    with open(out_path, "w") as f:
        json.dump(result, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:3])
