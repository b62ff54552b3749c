"""The processes of a rank's peers on this host: which exited, which are stopped.

A link between two processes of one host and pid namespace (shared memory, memlinks.py; a
NIXL agent between jobs, nixlagent.py) can see its peer's process, where a socket sees only
silence: an exited peer is named at once (a pidfd, `os.pidfd_open`, readable when the process
is gone), a stopped one (SIGSTOP, a debugger: state `T` or `t` in /proc/PID/stat) once it has
been stopped `watch_stopped` seconds. A peer elsewhere is not watched: its transport names it
(a closed connection, a probe) or the deadline does.
"""

from __future__ import annotations

import os
import select

LOOK_STOPPED = 0.02   # s between looks at the watched peers' process states


class PeerProcesses:
    """This rank's peers' processes: `add` each one on this host, `look` at them while waiting.

    >>> procs = PeerProcesses(watch_stopped=0.5)
    >>> procs.add(1, os.getpid())
    >>> list(procs.look([1], now=1.0))
    []
    >>> procs.close()
    """

    def __init__(self, watch_stopped: float | None = None):
        self.watch_stopped = watch_stopped   # s a peer may be stopped before it is named; None: never
        self.pids: dict[int, int] = {}       # peer -> its pid (this host, this pid namespace)
        self.fds: dict[int, int] = {}        # peer -> a pidfd of it, where the kernel gave one
        self._since: dict[int, float] = {}   # peer -> when its process was first seen stopped
        self._looked = 0.0

    def add(self, peer: int, pid: int) -> None:
        """Watch `peer`'s process `pid` (no pidfd where the kernel has none, or it already exited:
        the deadline, or the transport, names it then)."""
        self.pids[peer] = pid
        try:
            self.fds[peer] = os.pidfd_open(pid)
        except (OSError, AttributeError):
            pass

    def died(self, peer: int) -> str | None:
        """Why `peer` is gone, where its process exited; else None."""
        fd = self.fds.get(peer)
        if fd is not None and select.select([fd], [], [], 0)[0]:
            return f"peer rank {peer} died (process {self.pids[peer]} exited)"
        return None

    def stopped(self, peer: int, now: float) -> str | None:
        """Why `peer` is gone, where its process has been stopped `watch_stopped` s by `now`."""
        pid = self.pids.get(peer)
        if pid is None or self.watch_stopped is None:
            return None
        try:
            with open(f"/proc/{pid}/stat", "rb") as fh:
                state = fh.read().rsplit(b")", 1)[1].split()[0]
        except (OSError, IndexError):
            return None  # (gone: `died` says so)
        if state not in (b"T", b"t"):
            self._since.pop(peer, None)
            return None
        since = self._since.setdefault(peer, now)
        if now - since >= self.watch_stopped:
            return f"peer rank {peer} is stopped (process {pid} stopped for {now - since:.2g} s: SIGSTOP or a debugger)"
        return None

    def look(self, peers, now: float):
        """(peer, why) for each of `peers`, ascending, whose process exited or (every LOOK_STOPPED s,
        where watched) has been stopped long enough."""
        due = self.watch_stopped is not None and now - self._looked >= LOOK_STOPPED
        if due:
            self._looked = now
        for peer in sorted(peers):
            why = self.died(peer) or (self.stopped(peer, now) if due else None)
            if why is not None:
                yield peer, why

    def close(self) -> None:
        """Stop watching: close every pidfd."""
        for fd in self.fds.values():
            try:
                os.close(fd)
            except OSError:
                pass
        self.fds.clear()
