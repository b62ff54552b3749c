"""A statement's later iterations reuse what its first instance checked (driver.Repeat).

The reference is the full per-instance steps (`TENSOR_STEPS`), which the
elaborator took for every instance before: with `driver.repeat` switched off,
every instance goes through them. Every shipped example and a set of loops that
make the reuse fall back (a nested `over` loop's fresh frame, dims or `at` that
read the loop variable, `.local` names, stacked keys) must elaborate to the same
instances either way, and a mistake first made in a later iteration must give
the diagnostic written out here by hand.
"""

from pathlib import Path

import pytest

from layoutlang import LayoutError, load, loads
from layoutlang.elaborate import driver

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = sorted(p for p in (ROOT / "examples").rglob("*.layout"))
SMALL_ARGS = {"L": 10, "E": 16, "DP": 4, "EP": 4, "ENGINE_DP": 2, "ENGINE_EP": 16}  # MoE examples, a test's size

LOOPS = {
    "nested over loops": "mesh m (pp=2, ep=2, tp=2)\n"
                         "for l in 0..4 over pp { for e in 0..4 over ep { tensor l{l}.e{e}.w [8 over tp, 4] } }",
    "dims read the loop variable": "mesh m (pp=2, tp=2)\n"
                                   "for l in 0..4 over pp { tensor l{l}.w [(l + 1) * 2 over tp] }",
    "at reads the loop variable": "mesh m (pp=4, tp=2)\nfor l in 0..4 { tensor l{l}.w [8 over tp] at pp=3-l }",
    "local names": "mesh m (pp=2, tp=1)\nfor l in 0..5 over pp sizes [2, 3] { tensor x.{l.local}.w [4] }",
    "two statements, two meshes": "mesh a (pp=2, tp=2)\nmesh b (pp=2, tp=4) at 4\n"
                                  "for l in 0..4 over pp { tensor x{l} [8 over tp]\n tensor y{l} [8 over tp] on b }",
    "stacked keys": "mesh m (ep=2, tp=2)\n"
                    "for l in 0..3 { tensor l{l}.experts as l{l}.e{e}.w [e in 0..4 over ep, 8 over tp] }",
}
# instances each case builds from its statement's first one, counted by hand: the first
# instance of a statement in its loops takes the full steps, and so does one whose dims
# (read from the loop variable) or whose `over` frame (an inner loop's, made anew each outer
# iteration) is new
REUSED = {
    "nested over loops": 4 * 3,  # per l, e=0 meets a fresh inner frame
    "dims read the loop variable": 0,  # each l gives new dims
    "at reads the loop variable": 3,
    "local names": 4,
    "two statements, two meshes": 3 + 3,
    "stacked keys": 2,
}


def _instances(layout):
    """Each instance's fields (a span as its position: each load reads its own Source)."""
    return [(t.key, t.name, t.dtype, t.mesh, t.dims, t.fixed, t.logical_shape, t.local_shape,
             (t.span.line, t.span.col, t.span.end_line, t.span.end_col), t.regions) for t in layout.tensors]


@pytest.fixture
def counted(monkeypatch):
    """How many instances the reuse built (a test of it that never reuses proves nothing)."""
    hits = []
    real = driver.repeat

    def counting(el, seen):
        done = real(el, seen)
        hits.append(done)
        return done

    monkeypatch.setattr(driver, "repeat", counting)
    return hits


def _both(make, monkeypatch, counted):
    fast = make()
    reused = sum(counted)
    monkeypatch.setattr(driver, "repeat", lambda el, seen: False)
    return fast, make(), reused


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: str(p.relative_to(ROOT / "examples")))
def test_examples_elaborate_the_same_with_and_without_reuse(path, monkeypatch, counted):
    fast, full, _ = _both(lambda: load(path, SMALL_ARGS, unknown_args="ignore"), monkeypatch, counted)
    assert _instances(fast) == _instances(full)


def test_the_moe_example_reuses_most_instances(monkeypatch, counted):
    fast, full, reused = _both(lambda: load(ROOT / "examples" / "deepseek_v3_moe.layout", SMALL_ARGS,
                                            unknown_args="ignore"), monkeypatch, counted)
    assert _instances(fast) == _instances(full)
    assert reused > len(fast.tensors) // 2


@pytest.mark.parametrize("case", LOOPS, ids=list(LOOPS))
def test_loops_elaborate_the_same_with_and_without_reuse(case, monkeypatch, counted):
    fast, full, reused = _both(lambda: loads(LOOPS[case]), monkeypatch, counted)
    assert _instances(fast) == _instances(full)
    assert reused == REUSED[case]


def test_nested_over_loop_gives_each_instance_its_coordinates():
    layout = loads(LOOPS["nested over loops"])
    # pp=2 blocks of l: {0,1},{2,3}; ep=2 blocks of e: {0,1},{2,3}; ranks are (pp, ep, tp) row-major
    holders = {t.name: [r for r in range(8) if t.holds(r)] for t in layout.tensors}
    assert holders["l0.e0.w"] == [0, 1]
    assert holders["l1.e3.w"] == [2, 3]
    assert holders["l2.e1.w"] == [4, 5]
    assert holders["l3.e2.w"] == [6, 7]


def test_dims_that_read_the_loop_variable_follow_it():
    layout = loads(LOOPS["dims read the loop variable"])
    assert [(t.name, t.logical_shape, t.local_shape) for t in layout.tensors] == [
        ("l0.w", (2,), (1,)), ("l1.w", (4,), (2,)), ("l2.w", (6,), (3,)), ("l3.w", (8,), (4,))]


def test_at_that_reads_the_loop_variable_follows_it():
    layout = loads(LOOPS["at reads the loop variable"])
    assert [[r for r in range(8) if t.holds(r)] for t in layout.tensors] == [[6, 7], [4, 5], [2, 3], [0, 1]]


def _diagnostic(text: str) -> list[str]:
    with pytest.raises(LayoutError) as e:
        loads(text, "loop.layout")
    return str(e.value).splitlines()


def test_at_out_of_range_in_a_later_iteration_is_reported_there():
    lines = _diagnostic("mesh m (pp=2)\nfor l in 0..3 { tensor l{l}.w [4] at pp=l }")
    # line 2, the coordinate `l` after `at pp=` (column 41)
    assert lines[0] == "loop.layout:2:41: error: `at pp=2` is out of range: pp has coordinates 0..1"
    assert lines[-1] == "help: use `at pp=pp-1` for the last one"


def test_a_dims_mistake_in_a_later_iteration_is_reported_there():
    lines = _diagnostic("mesh m (tp=2)\nfor l in 0..3 { tensor l{l}.w [2 - l over tp] }")
    # l=1 gives extent 1, which does not split over tp=2 (l=0's extent 2 did); at `2 - l` (column 32)
    assert lines[0] == "loop.layout:2:32: error: split 1 over tp=2 leaves remainder 1"
    assert lines[-1] == "help: use `pad 2` or change tp"


def test_a_key_repeated_in_a_later_iteration_is_reported_there():
    lines = _diagnostic("mesh m (pp=2)\nfor l in 0..2 over pp { tensor w [4] }")
    assert lines[0] == "loop.layout:2:32: error: key `w` repeats across iterations of this statement"
