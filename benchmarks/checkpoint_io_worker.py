"""One of the 4 processes of benchmarks/checkpoint_io.py (see there): loads and saves, timed.

Usage: python benchmarks/checkpoint_io_worker.py JOB OUT   (env RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT)

In order: the fused layout loaded, `plan_load` timed (first call in the process); the
layoutlang shards allocated, one load and one save (RSS recorded after each, checked); then
the DCP DTensors and the floor's buffer, one DCP load and one DCP save (checked), one write
of each floor (untimed warm-ups); then the
load rounds (layoutlang, DCP) and the save rounds (floor, floor with fsync, layoutlang repeated,
layoutlang first save with its plans dropped, in place, DCP),
each method between two barriers, timed on this rank; between save methods the outputs are
removed and rank 0 runs `os.sync()`, untimed. Writes {"ok": true, ...} or the error.
"""

from __future__ import annotations

import cProfile
import faulthandler
import io
import json
import os
import pstats
import resource
import shutil
import signal
import sys
import time
import traceback
import warnings
from datetime import timedelta
from pathlib import Path

warnings.filterwarnings("ignore")
faulthandler.register(signal.SIGUSR1, all_threads=True)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from checkpoint_io import WORLD, expected, keys, parts, same_bits  # noqa: E402
from refit_gloo import round_order  # noqa: E402

MIB = 2**20


def maxrss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


class Sampler:
    """The peaks of VmRSS, RssAnon and RssFile (/proc/self/status) while a block runs, sampled
    every 2 ms from a thread (torch's copies release the GIL): what ru_maxrss cannot split."""

    FIELDS = ("VmRSS", "RssAnon", "RssFile")

    def __enter__(self):
        import threading

        self.peak = dict.fromkeys(self.FIELDS, 0)
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.sample()
        self.thread.start()
        return self

    def sample(self) -> None:
        with open("/proc/self/status") as fh:
            for line in fh:
                name = line.split(":", 1)[0]
                if name in self.peak:
                    self.peak[name] = max(self.peak[name], int(line.split()[1]) * 1024)

    def _run(self) -> None:
        while not self.stop.wait(0.002):
            self.sample()

    def __exit__(self, *exc):
        self.stop.set()
        self.thread.join()
        self.sample()


def barrier() -> None:
    dist.barrier()


def timed(fn) -> float:
    barrier()
    t0 = time.perf_counter()
    fn()
    barrier()
    return time.perf_counter() - t0


class Bench:
    def __init__(self, job: dict, rank: int):
        from layoutlang.elaborate import loads

        self.job, self.rank = job, rank
        self.s = job["sizes"]
        self.ckpt = Path(job["ckpt"])
        self.out = Path(job["out"])
        self.layout = loads(job["fused"], "<checkpoint_io fused>")
        self.problems: list[str] = []
        self.n = 0

    def fresh(self, tag: str) -> Path:
        self.n += 1
        return self.out / f"{tag}-{self.n}"

    def cleanup(self, path: Path) -> None:
        barrier()
        if self.rank == 0:
            shutil.rmtree(path, ignore_errors=True)
            os.sync()
        barrier()

    # -- layoutlang
    def ll_load(self) -> None:
        from layoutlang.checkpoint import load

        load(self.ckpt, self.layout, self.tensors, group=dist.group.WORLD, budget_bytes=self.job["budget"])

    def ll_save(self, path: Path, exchange: bool | None = None):
        from layoutlang.checkpoint import save

        return save(path, self.layout, self.tensors, group=dist.group.WORLD, max_shard_size=self.max_shard,
                    exchange=exchange)

    # -- DCP
    def dcp_load(self) -> None:
        import torch.distributed.checkpoint as dcp

        dcp.load(self.dstate, storage_reader=dcp.HuggingFaceStorageReader(str(self.ckpt)))

    def dcp_save(self, path: Path) -> None:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint._consolidate_hf_safetensors import consolidate_safetensors_files_on_every_rank

        sharded = path / "sharded"
        dcp.save(self.dstate, storage_writer=dcp.HuggingFaceStorageWriter(
            str(sharded), save_distributed=True, fqn_to_index_mapping=self.fqn_index))
        consolidate_safetensors_files_on_every_rank(str(sharded), str(path), self.fqn_index)

    # -- the floor
    def floor(self, path: Path, sync: bool) -> None:
        fd = os.open(path / f"rank{self.rank}.bin", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            view, at = memoryview(self.buffer.numpy()), 0
            while at < len(view):
                at += os.pwrite(fd, view[at:at + (1 << 30)], at)
            if sync:
                os.fsync(fd)
        finally:
            os.close(fd)

    def check_saved(self, path: Path, what: str) -> None:
        """Rank 0: every key of the saved checkpoint equals the original's."""
        if self.rank != 0:
            return
        from safetensors import safe_open

        def tensors(root: Path) -> dict:
            index = json.loads((root / "model.safetensors.index.json").read_text())["weight_map"] \
                if (root / "model.safetensors.index.json").exists() else None
            files = sorted(set(index.values())) if index else sorted(p.name for p in root.glob("*.safetensors"))
            return {f: root / f for f in files}

        orig = {}
        for f, p in tensors(self.ckpt).items():
            with safe_open(str(p), "pt") as fh:
                orig.update({k: (p, k) for k in fh.keys()})
        seen = set()
        for f, p in tensors(path).items():
            with safe_open(str(p), "pt") as fh:
                for k in fh.keys():
                    seen.add(k)
                    if k not in orig:
                        self.problems.append(f"{what}: key {k} is not in the checkpoint")
                        continue
                    with safe_open(str(orig[k][0]), "pt") as fo:
                        if not same_bits(fh.get_tensor(k), fo.get_tensor(k)):
                            self.problems.append(f"{what}: key {k} differs")
        missing = set(orig) - seen
        if missing:
            self.problems.append(f"{what}: {len(missing)} key(s) missing, e.g. {sorted(missing)[0]}")

    def check_loaded(self, got: dict, what: str) -> None:
        want = expected(self.ckpt, self.s, "fused" if what == "layoutlang" else "hf", self.rank)
        bad = [n for n in want if not same_bits(got[n], want[n])]
        if bad:
            self.problems.append(f"{what} load: {len(bad)} tensor(s) differ, e.g. {bad[0]}")

    def run(self) -> dict:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import DTensor, Replicate, Shard

        from layoutlang.checkpoint import plan_load

        report: dict = {"rank": self.rank}
        barrier()
        t0, c0 = time.perf_counter(), time.process_time()
        plan_load(self.ckpt, self.layout)
        report["plan_first"] = (time.perf_counter() - t0, time.process_time() - c0)

        # layoutlang alone first: its RSS
        self.tensors = {t.name: torch.zeros(t.local_shape_at(self.rank), dtype=torch.bfloat16)
                        for t in self.layout.tensors if t.holds(self.rank)}
        shard_bytes = sum(t.numel() * 2 for t in self.tensors.values())
        self.max_shard = (self.job["total"] + self.job["files"] - 1) // self.job["files"] + 16 * MIB
        with Sampler() as sampled:
            pass
        rss = {"shards": maxrss(), "shards_now": sampled.peak}
        with Sampler() as sampled:
            self.ll_load()
        rss["load"] = maxrss()
        rss["load_peaks"] = sampled.peak
        self.check_loaded(self.tensors, "layoutlang")
        path = self.fresh("layoutlang")
        with Sampler() as sampled:
            rep = self.ll_save(path)
        rss["save"] = maxrss()
        rss["save_peaks"] = sampled.peak
        report["saved_files"] = len([f for f in rep.files if f.endswith(".safetensors")])
        report["max_shard_size"] = self.max_shard
        self.check_saved(path, "layoutlang save")
        self.cleanup(path)
        report["exchanged"] = len(rep.exchanged)
        report["transport"] = rep.transport
        path = self.fresh("in_place")
        self.ll_save(path, exchange=False)
        self.check_saved(path, "layoutlang save, in place")
        self.cleanup(path)

        # DCP: the HF keys as DTensors, each rank the same slices
        mesh = init_device_mesh("cpu", (WORLD,))
        self.dstate = {}
        for k, shape, dim, _ in keys(self.s):
            local = list(shape)
            if dim is not None:
                local[dim] //= WORLD
            t = torch.zeros(local, dtype=torch.bfloat16)
            self.dstate[k] = DTensor.from_local(t, mesh, [Replicate() if dim is None else Shard(dim)], run_check=False)
        index = json.loads((self.ckpt / "model.safetensors.index.json").read_text())["weight_map"]
        names = sorted(set(index.values()))
        self.fqn_index = {k: names.index(f) + 1 for k, f in index.items()}
        self.dcp_load()
        self.check_loaded({k: v.to_local() for k, v in self.dstate.items()}, "dcp")
        path = self.fresh("dcp")
        self.dcp_save(path)
        self.check_saved(path, "DCP save")
        self.cleanup(path)
        share = self.job["total"] // WORLD
        self.buffer = torch.ones(share, dtype=torch.uint8)

        # load rounds
        lt: dict[str, list[float]] = {"layoutlang": [], "dcp": []}
        last = None
        for i in range(self.job["rounds"]):
            order = round_order(list(lt), i, last)
            for m in order:
                lt[m].append(timed(self.ll_load if m == "layoutlang" else self.dcp_load))
            last = order[-1]
        self.check_loaded(self.tensors, "layoutlang")

        # save rounds
        for m in ("floor", "floor_fsync"):  # warm-up (the first writes into new files run slow)
            path = self.fresh(m)
            if self.rank == 0:
                path.mkdir(parents=True, exist_ok=True)
            timed(lambda: self.floor(path, m == "floor_fsync"))
            self.cleanup(path)

        st: dict[str, list[float]] = {"floor": [], "floor_fsync": [], "layoutlang": [], "cold": [], "in_place": [],
                                      "dcp": []}
        last = None
        for i in range(self.job["save_rounds"]):
            order = round_order(list(st), i, last)
            for m in order:
                path = self.fresh(m)
                if m == "floor" or m == "floor_fsync":
                    if self.rank == 0:
                        path.mkdir(parents=True, exist_ok=True)
                    st[m].append(timed(lambda: self.floor(path, m == "floor_fsync")))
                elif m == "layoutlang":  # a repeated save: its plans kept from the earlier ones
                    st[m].append(timed(lambda: self.ll_save(path)))
                elif m == "cold":  # a first save: the plans made again (the kept ones dropped, untimed)
                    from layoutlang.checkpoint import layouts

                    layouts._PLANS.clear()
                    st[m].append(timed(lambda: self.ll_save(path)))
                elif m == "in_place":  # every piece written where it lies (no key exchanged)
                    st[m].append(timed(lambda: self.ll_save(path, exchange=False)))
                else:
                    st[m].append(timed(lambda: self.dcp_save(path)))
                self.cleanup(path)
            last = order[-1]
        rss["end"] = maxrss()

        prof_text = None
        if self.job["profile"]:  # untimed: one load and one save, rank 0 under cProfile
            path = self.fresh("profile")
            for what, fn in (("load", self.ll_load), ("save", lambda: self.ll_save(path))):
                barrier()
                prof = cProfile.Profile() if self.rank == 0 else None
                t0 = time.perf_counter()
                if prof:
                    prof.enable()
                fn()
                if prof:
                    prof.disable()
                    buf = io.StringIO()
                    pstats.Stats(prof, stream=buf).sort_stats("cumulative").print_stats(30)
                    prof_text = (prof_text or "") + (f"{what} ({1e3 * (time.perf_counter() - t0):.0f} ms under "
                                                     f"the profiler):\n" + buf.getvalue())
            self.cleanup(path)
        report.update({"load_times": lt, "save_times": st, "rss": rss, "shard_bytes": shard_bytes,
                       "problems": self.problems, "profile": prof_text})
        return report


def main() -> None:
    job_path, out_path = sys.argv[1], sys.argv[2]
    try:
        job = json.loads(Path(job_path).read_text())
        dist.init_process_group("gloo", timeout=timedelta(seconds=180))
        report = Bench(job, dist.get_rank()).run()
        dist.barrier()
        report["ok"] = True
        Path(out_path).write_text(json.dumps(report))
        dist.destroy_process_group()
    except BaseException as e:  # noqa: BLE001 - reported to the launcher
        Path(out_path).write_text(json.dumps({"ok": False, "error": f"{type(e).__name__}: {e}",
                                              "trace": traceback.format_exc()}))
        sys.exit(1)


if __name__ == "__main__":
    main()
