"""The frame of a bridge test program: `launch(job, n, program=PATH)` runs PATH as
`python PATH JOB.json OUT.json` on each of n gloo ranks (layoutlang/runtime/launch.py).

`run(body)` reads the job, joins the gloo group, calls `body(job, rank)` for the
rank's report (a JSON-able dict), meets the other ranks, and writes the report with
`"ok": true`. Whatever goes wrong is written instead, with its traceback, and the
process exits 1: the test reads the reason from the result file. (Imported by path:
a script's own folder is first on sys.path.)
"""

from __future__ import annotations

import datetime
import json
import sys
import traceback
from typing import Callable

import torch.distributed as dist


def run(body: Callable[[dict, int], dict], timeout_s: float = 120.0) -> None:
    job_path, out_path = sys.argv[1], sys.argv[2]
    try:
        with open(job_path) as f:
            job = json.load(f)
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=timeout_s))
        report = body(job, dist.get_rank())
        dist.barrier()
        report["ok"] = True
        with open(out_path, "w") as f:
            json.dump(report, f)
        dist.destroy_process_group()
    except BaseException as e:
        with open(out_path, "w") as f:
            json.dump({"ok": False, "error": f"{type(e).__name__}: {e}", "trace": traceback.format_exc()}, f)
        sys.exit(1)
