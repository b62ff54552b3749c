"""The test seam of examples/jobs/: a rank that dies while bytes move (`--die-refit`, `--die-rank`)."""

from __future__ import annotations

import os
import signal

from layoutlang.runtime import RefitHooks


class DieInBucket(RefitHooks):
    """SIGKILL this rank as bucket 1 of refit `refit` starts (bytes are moving)."""

    def __init__(self, refit: int):
        self.refit = refit

    def before_bucket(self, refitter, step, bucket):
        if step == self.refit and bucket == 1:
            os.kill(os.getpid(), signal.SIGKILL)
