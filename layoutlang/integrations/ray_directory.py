"""A refit job's name in a Ray cluster: a named actor that says where the job's store is.

Trainer rank 0 of a `RayTrainerJob` (layoutlang/integrations/ray.py) hosts the job's store
and starts one `JobDirectory` actor named after the job, in the Ray namespace `layoutlang`
(so drivers of other Ray jobs on the cluster find it too), holding
``{"job": NAME, "address": "HOST:PORT", "node_id": ...}``; every other rank looks the name up
(`lookup`) and connects to the address as `TrainerJob` / `EngineJob` do.

Why a named actor and not the GCS key-value store: named actors are Ray's public, documented
way to find something by name (`ray.get_actor(name, namespace=...)`, `.options(name=...)`);
the key-value store is reachable from Python only through `ray.experimental.internal_kv`'s
underscore functions, which Ray documents as internal and may change in any release. The
actor also gives the name the job's lifetime for free: it is not detached, so Ray ends it
(and frees the name) when its owner, trainer rank 0's process, dies, and when its last handle
(the job's) goes; `close` ends it at once.
It costs one small Ray worker process (0 CPUs; this module imports neither torch nor the
rest of layoutlang, so that process stays a bare Python with Ray).

Ray is imported by the caller (`ray` passed in): nothing here imports it.
"""

from __future__ import annotations

import time

NAMESPACE = "layoutlang"   # the Ray namespace every job's name lives in
LOOK = 0.1                 # s between two looks for a name that is not there (yet)


class JobDirectory:
    """The actor behind a job's name: what trainer rank 0 published, read by everyone else."""

    def __init__(self, record: dict):
        self._record = dict(record)

    def record(self) -> dict:
        return self._record


def publish(ray, name: str, record: dict, deadline: float):
    """Start the actor named `name` holding `record`; its handle. A name held by a live job is
    refused at once (`NameTaken`, with that job's record); one whose holder died and that Ray
    has not released yet is tried again until `deadline` (time.monotonic())."""
    actor = ray.remote(num_cpus=0)(JobDirectory)
    while True:
        try:
            return actor.options(name=name, namespace=NAMESPACE, max_restarts=0).remote(record)
        except ValueError:  # the name is taken
            holder = _record_of(ray, name, 2.0)
            if holder is not None or time.monotonic() >= deadline:
                raise NameTaken(holder) from None
            time.sleep(LOOK)


class NameTaken(Exception):
    """`publish` found the name taken: `holder` is the live job's record (None: a dead one's)."""

    def __init__(self, holder: dict | None):
        super().__init__(holder)
        self.holder = holder


def lookup(ray, name: str, deadline: float) -> dict | None:
    """The record published under `name`, waiting for it to appear until `deadline`
    (time.monotonic()); None if it did not."""
    while True:
        record = _record_of(ray, name, max(deadline - time.monotonic(), LOOK))
        if record is not None:
            return record
        if time.monotonic() >= deadline:
            return None
        time.sleep(LOOK)


def _record_of(ray, name: str, wait: float) -> dict | None:
    """The record of the live actor named `name`, asked within `wait` s; None when there is no
    such actor, it died (its name not yet released), or it does not answer in time."""
    try:
        handle = ray.get_actor(name, namespace=NAMESPACE)
    except ValueError:
        return None
    try:
        return ray.get(handle.record.remote(), timeout=wait)
    except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
        return None
