"""A figure measured in fresh processes: the planning benchmarks' one helper for that.

Each run is a new interpreter (`python -c CODE ARGS...`), so no cache or memo
of an earlier run helps a later one; the child prints its result as JSON on
its last line, with the `seconds` it measured, and the fastest of `repeat`
runs is kept (the machine's noise only ever adds time).
"""

from __future__ import annotations

import json
import subprocess
import sys


def fastest(code: str, args: list[str], what: str, repeat: int, timeout: float = 900) -> dict:
    """The result of the fastest of `repeat` fresh children; exits naming `what` if one fails."""
    best = None
    for _ in range(repeat):
        out = subprocess.run([sys.executable, "-c", code, *map(str, args)], capture_output=True, text=True, check=False,
                             timeout=timeout)
        if out.returncode != 0:
            raise SystemExit(f"{what}: the child failed:\n{out.stderr[-3000:]}")
        r = json.loads(out.stdout.strip().splitlines()[-1])
        best = r if best is None or r["seconds"] < best["seconds"] else best
    return best
