"""Refit between jobs whose ranks are Ray actors: `RayTrainerJob` and `RayEngineJob` (docs/jobs.md, "Ray").

They are `TrainerJob` and `EngineJob` (layoutlang/runtime/jobs.py) with one argument more:
`name=`, the job's name in the Ray cluster, which may replace `address=`::

    # in every trainer actor (its own torch world, as any trainer job)
    job = RayTrainerJob("train.layout", "infer.layout", name="policy", rank=r, world_size=N)
    report = job.refit(dict(model.named_parameters()), version=step)
    # in every actor of one engine replica
    eng = RayEngineJob("infer.layout", name="policy", replica="rollout-3", rank=t, world_size=TP)
    version = eng.receive(dict(model.named_parameters()))

Trainer rank 0 hosts the job's store on its node's address (a free port) and publishes the
address under the name (a named actor: layoutlang/integrations/ray_directory.py); every other
rank, trainer or engine, waits for the name to appear (up to `connect_timeout`, else
`timeout`) and connects there. Given `address=` as well, rank 0 hosts the store there and
publishes that, and the others connect without looking the name up.

A replica actor that Ray restarts (`max_restarts`) runs its constructor again, so its
`RayEngineJob` starts again under the same replica id: a new incarnation of that replica,
which the trainer plans at the next refit where every rank of it waits (docs/jobs.md,
"Incarnations"); nothing here adds to that.

Every rank publishes the Ray node it runs on (`ray.get_runtime_context().get_node_id()`,
its `node_id`) in the job's store, `node/trainer/<rank>` and `node/replica/<R>/<rank>`, before
it can take part in a refit; `node_of(rank, replica)` reads them, so a transport choice can
tell which ranks share a host.

Ray is imported inside the constructors: importing this module imports no Ray.
"""

from __future__ import annotations

import time
from datetime import timedelta

import torch.distributed as dist

from layoutlang.diagnostics import UsageError
from layoutlang.runtime.errors import RefitError
from layoutlang.runtime.jobs import REPLICA_ID, EngineJob, TrainerJob

from .ray_directory import NAMESPACE, NameTaken, lookup, publish

__all__ = ["RayTrainerJob", "RayEngineJob", "node_key"]

DEFAULT_TIMEOUT = 60.0   # s, TrainerJob's and EngineJob's default `timeout`


def _ray():
    """The `ray` module, in a process where Ray runs (a driver after ray.init, an actor, a task)."""
    try:
        import ray
    except ImportError:
        raise UsageError("layoutlang.integrations.ray needs Ray, which is not installed",
                         help="pip install 'layoutlang[ray]'") from None
    if not ray.is_initialized():
        raise UsageError("Ray is not initialized in this process",
                         help="call ray.init() first (Ray actors and tasks run initialized)")
    return ray


def _seconds(options: dict) -> float:
    """How long a rank waits for the job's name: `connect_timeout`, else `timeout`, as jobs.py reads them."""
    t = options.get("connect_timeout") or options.get("timeout", DEFAULT_TIMEOUT)
    return t.total_seconds() if isinstance(t, timedelta) else float(t)


def _check(name, address, store) -> None:
    if name is None and address is None and store is None:
        raise UsageError("a Ray job needs name= (its name in the Ray cluster) or address= (HOST:PORT of its store)")
    if name is not None and (not isinstance(name, str) or not REPLICA_ID.fullmatch(name)):
        raise UsageError(f"job name {name!r}: expected letters, digits, `.`, `_` or `-` (at most 128)")


def _address(ray, name: str, wait: float, who: str, rank: int) -> str:
    """The address published under `name`, waiting for it up to `wait` s."""
    record = lookup(ray, name, time.monotonic() + wait)
    if record is None:
        raise RefitError(f"{who}: setup: no trainer job named {name!r} in this Ray cluster within {wait:g} s",
                         rank=rank, phase="setup", detail=f"no trainer job named {name!r} within {wait:g} s",
                         help=f"start the trainer job with name={name!r} in the same Ray cluster (its rank 0 "
                              f"publishes its store's address under that name, in Ray namespace {NAMESPACE!r}), "
                              "or pass address=")
    return record["address"]


def node_key(rank: int, replica: str | None = None) -> str:
    """The store key (under the job's namespace) where a rank publishes its Ray node id.

    >>> node_key(1), node_key(0, "rollout-3")
    ('node/trainer/1', 'node/replica/rollout-3/0')
    """
    return f"node/trainer/{rank}" if replica is None else f"node/replica/{replica}/{rank}"


class _OnRayNodes:
    """What both jobs add: this rank's Ray node id, published in the job's store."""

    node_id: str

    def _publish_node(self, ray, rank: int, replica: str | None = None) -> None:
        self.node_id = ray.get_runtime_context().get_node_id()
        self.kv.set(node_key(rank, replica), self.node_id)

    def node_of(self, rank: int, replica: str | None = None) -> str | None:
        """The Ray node id of trainer rank `rank` (`replica` None) or of replica `replica`'s rank
        `rank`, as that rank published it when it started (None: it has not)."""
        key = node_key(rank, replica)
        return self.kv.get(key) if self.kv.has(key) else None


class RayTrainerJob(_OnRayNodes, TrainerJob):
    """`TrainerJob` in a Ray actor (or driver): `name=` instead of, or beside, `address=`.

    Rank 0 hosts the store (at `address`, or on its node's IP and a free port) and publishes
    its address under `name`; a second live job of that name is refused (UsageError). The
    other ranks wait for the name. Every other argument and method is `TrainerJob`'s; `close`
    on rank 0 also gives the name back."""

    def __init__(self, train, infer, *, name: str | None = None, address: str | None = None, rank: int,
                 world_size: int, store=None, **options):
        _check(name, address, store)
        ray = _ray()
        wait = _seconds(options)
        self.name, self._directory = name, None
        if name is not None and rank == 0 and address is None:
            if store is not None:
                raise UsageError(f"job {name!r}: with store= give address= too (rank 0 publishes the address of "
                                 "the store under the name)")
            host = ray.util.get_node_ip_address()
            try:
                store = dist.TCPStore(host, 0, None, True, timedelta(seconds=wait), wait_for_workers=False)
            except (dist.DistError, RuntimeError, OSError) as exc:
                raise RefitError(f"trainer rank 0: setup: cannot host job {name!r}'s store on {host}: {exc}",
                                 rank=0, phase="setup") from None
            published = f"{host}:{store.port}"
        else:
            published = address
            if address is None and store is None:
                address = _address(ray, name, wait, f"trainer rank {rank}", rank)
        super().__init__(train, infer, address=None if store is not None else address, rank=rank,
                         world_size=world_size, store=store, **options)
        self._publish_node(ray, rank)
        if name is not None and rank == 0:
            record = {"job": name, "address": published, "node_id": self.node_id}
            try:
                self._directory = publish(ray, name, record, time.monotonic() + wait)
            except NameTaken as taken:
                where = f" (its store at {taken.holder['address']})" if taken.holder else ""
                raise UsageError(f"a trainer job named {name!r} already runs in this Ray cluster{where}",
                                 help="give this job another name, or close that one first") from None

    def close(self) -> None:
        """`TrainerJob.close`; rank 0 then ends the job's name (a new job may take it)."""
        super().close()
        if self._directory is not None:
            import ray

            ray.kill(self._directory)
            self._directory = None


class RayEngineJob(_OnRayNodes, EngineJob):
    """`EngineJob` in a Ray actor: `name=` (the trainer job's) instead of `address=`.

    Each rank waits for the name to appear (up to `connect_timeout`, else `timeout`), then is
    an `EngineJob` of the store published there. Built again under the same `replica` (as a
    restarted actor's constructor does), it is that replica's next incarnation."""

    def __init__(self, infer, *, name: str | None = None, address: str | None = None, replica: str, rank: int,
                 world_size: int, store=None, **options):
        _check(name, address, store)
        ray = _ray()
        self.name = name
        if address is None and store is None:
            address = _address(ray, name, _seconds(options), f"replica {replica} rank {rank}", rank)
        super().__init__(infer, address=address, replica=replica, rank=rank, world_size=world_size, store=store,
                         **options)
        self._publish_node(ray, rank, replica)
