"""The test seam of examples/jobs/: a rank that dies while bytes move (`--die-refit`, `--die-rank`,
`--die-bucket`)."""

from __future__ import annotations

import os
import signal

from layoutlang.runtime import RefitHooks


class DieInBucket(RefitHooks):
    """SIGKILL this rank as bucket `bucket` of refit `refit` starts: bytes are moving (the
    other ranks' into and out of it; with bucket 1, this rank's own of bucket 0 are done)."""

    def __init__(self, refit: int, bucket: int = 1):
        self.refit, self.bucket = refit, bucket

    def before_bucket(self, refitter, step, bucket):
        if step == self.refit and bucket == self.bucket:
            os.kill(os.getpid(), signal.SIGKILL)
