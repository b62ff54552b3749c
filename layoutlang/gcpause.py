"""Pause Python's cyclic garbage collector around allocation-heavy pure stages.

Elaboration and planning build hundreds of thousands of small objects that
form no reference cycles; the cyclic collector would re-scan them over and
over (about 40% of a DeepSeek-size compile). Reference counting still frees
everything; the collector runs again as soon as the stage is done.
"""

from __future__ import annotations

import gc
from contextlib import contextmanager


@contextmanager
def gc_paused():
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()
