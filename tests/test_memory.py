"""Caches belong to what they describe: a process that plans many pairs and drops them keeps nothing.

A trainer or a planning service compiles many different pairs; memos that
outlive their plans (process-wide dicts, unbounded lru_caches) grow without
bound. 100 different pairs, planned and dropped, must leave < 2 MiB behind.
"""

import gc
import tracemalloc

from layoutlang import loads
from layoutlang.compiler import compile_plan


def _pair(i: int):
    tp, dp, tp2 = 2 ** (i % 3), 1 + i % 4, 2 ** ((i + 1) % 3)
    rows, cols = 8 * (i + 3), 4 * (i % 7 + 1)
    src = loads(f"mesh s (dp={dp}, tp={tp})\n"
                f"for l in 0..{1 + i % 5} {{\n"
                f"  tensor layers.{{l}}.w [{rows} over tp, {cols}]\n"
                f"  tensor layers.{{l}}.fc [(gate: {rows} | up: {rows}) over tp, {cols + 4}]\n"
                f"}}\n"
                f"tensor norm{i} [{cols * 2}]\n", f"src{i}.layout")
    dst = loads(f"mesh d (tp={tp2}) at {i % 3}\n"
                f"for l in 0..{1 + i % 5} {{\n"
                f"  tensor layers.{{l}}.w [{rows}, {cols} over tp]\n"
                f"  tensor layers.{{l}}.fc [(gate: {rows} | up: {rows}) over tp, {cols + 4}] fp32\n"
                f"}}\n"
                f"tensor norm{i} [{cols * 2}]\n", f"dst{i}.layout")
    return src, dst


def _plan_and_drop(first: int, count: int) -> None:
    for i in range(first, first + count):
        plan = compile_plan(*_pair(i))
        assert plan.ops and plan.stats["bytes"] > 0
        del plan


def test_planning_100_pairs_and_dropping_them_keeps_under_2_mib():
    _plan_and_drop(1000, 5)  # warm: grammar, imports, first-use structures
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        _plan_and_drop(0, 100)
        gc.collect()
        after = tracemalloc.get_traced_memory()[0]
    finally:
        tracemalloc.stop()
    assert after - before < 2 * 1024 * 1024, f"{(after - before) / 2**20:.2f} MiB kept"
