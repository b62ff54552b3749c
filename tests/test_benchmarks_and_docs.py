"""What CI did not run before: the benchmarks' self-checks, the doctests of layoutlang/compiler/ and
layoutlang/runtime/, and the command samples of docs/cli.md and README.md.

- `benchmarks/naive_planner.py --selfcheck` and `benchmarks/plan_scale.py --quick`
  run as subprocesses (together well under a minute on 2 cores): exit 0 and the
  figures they exist to print. Their exit status is what this checks, so the
  benchmarks' own failure paths are tested here too, on hand-made inputs: the
  naive planner's comparison fails when it cannot see the real candidate sets,
  the layout-based lower bound of plan_scale gives hand-computed numbers, a
  missed refit target is reported. No timing is asserted anywhere.
- Doctests of `layoutlang.compiler.*` and `layoutlang.runtime.*`, imported under
  their installed names. (`--doctest-modules` over `layoutlang/compiler/` and `layoutlang/runtime/`
  would import them a second time as top-level `compiler` / `runtime` packages,
  names DESIGN.md says nothing may claim; the `layoutlang/` folder is collected
  by pyproject's testpaths as before.)
- docs/cli.md: every fenced block whose first line starts with `$ ` is a
  session: `$ cat FILE` lines write FILE (the lines up to the next `$`), `$
  layoutc ...` lines run `layoutc` in-process, and the text up to the next `$`
  must equal standard output then standard error (doctest's ELLIPSIS: `...`
  stands for any text). It runs in a scratch folder whose `examples/` is the
  repository's, so paths print as the docs show them. README.md shows commands
  without output: each runs and exits 0 (optional `[...]` parts dropped;
  `layoutc run` is left to tests/test_runtime*.py).
"""

from __future__ import annotations

import doctest
import importlib
import importlib.util
import os
import pkgutil
import re
import shlex
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "benchmarks"
sys.path.insert(0, str(BENCH))


def _run(*args: str, timeout: int = 240) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout)


# ---------------------------------------------------------------------------
# Benchmarks


@pytest.mark.timeout(300)
def test_naive_planner_selfcheck():
    proc = _run("benchmarks/naive_planner.py", "--selfcheck")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = proc.stdout.splitlines()
    pairs = [line for line in lines if line.startswith(("ok ", "FAIL "))]
    assert len(pairs) == 8 and all(line.startswith("ok ") for line in pairs), proc.stdout
    assert all(re.search(r"busiest sender real \d+\.\d{3}x, naive \d+\.\d{3}x floor", line) for line in pairs)
    assert lines[-1] == "selfcheck: all pairs agree"


@pytest.mark.timeout(300)
def test_replicas_scale_small():
    proc = _run("benchmarks/replicas_scale.py", "--sizes", "1024,4096")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = proc.stdout.splitlines()
    assert [line.split(":")[0] for line in lines if not line.startswith(" ")] == ["identity", "disjoint", "result"]
    rows = [line for line in lines if line.startswith("  N=")]
    assert len(rows) == 4 and not any("WRONG" in line for line in rows), proc.stdout
    assert lines[-1] == "result: ok"


@pytest.mark.timeout(300)
def test_balance_scale_quick():
    proc = _run("benchmarks/balance_scale.py", "--quick")
    assert proc.returncode == 0, proc.stdout + proc.stderr


@pytest.mark.timeout(300)
def test_store_scale_quick():
    """Every client passes every real Rendezvous meeting; the model rows are printed."""
    proc = _run("benchmarks/store_scale.py", "--quick", "--meetings", "5")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = [line.split() for line in proc.stdout.splitlines() if line.strip()[:1].isdigit()]
    assert [int(r[0]) for r in rows[:2]] == [4, 16] and not any("FAILED" in r for r in rows), proc.stdout
    assert proc.stdout.count("ranks,") == 4  # 1,024 and 8,192 ranks x 4 and 32 buckets


@pytest.mark.timeout(300)
def test_stacked_scale_quick():
    proc = _run("benchmarks/stacked_scale.py", "--quick", "--repeat", "1")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = proc.stdout
    assert re.search(r"\n  per-expert: one rank [\d.]+ s \(\d+ ops\), full plan [\d.]+ s \((\d+) ops", out), out
    assert re.search(r"\n     stacked: one rank [\d.]+ s \(\d+ ops\), full plan [\d.]+ s \((\d+) ops", out), out
    assert "WRONG" not in out and out.rstrip().endswith("result: ok")


@pytest.mark.timeout(300)
def test_replan_eplb_quick():
    proc = _run("benchmarks/replan_eplb.py", "--quick")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.count("re-plan / cold") == 4, proc.stdout  # 3 rounds and the median
    assert "verdict: --quick is a smoke run (checks pass" in proc.stdout


@pytest.mark.timeout(300)
def test_strided_scale_quick():
    proc = _run("benchmarks/strided_scale.py", "--quick", "--repeat", "1")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = proc.stdout
    assert re.search(r"\n   per-row: \d+ ops \(0 strided\)", out), out
    assert re.search(r"\n   strided: \d+ ops \([1-9]\d* strided\)", out), out
    assert "WRONG" not in out and out.rstrip().endswith("result: ok")


@pytest.mark.timeout(300)
def test_gpu_refit_selfcheck_on_cpu():
    """The one-device script, at CPU size: the raw copy loop, the Refitter's steps in one process
    (quantized wire) and a relay plan, each destination sample checked element by element."""
    proc = _run("benchmarks/gpu_refit.py", "--device", "cpu", "--small", "--steps", "1")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = proc.stdout
    assert out.count("destination tensors element by element: ok") == 3, out
    assert re.search(r"; [1-9]\d* ops on the quantized wire, 0 relays", out), out
    assert re.search(r"; [1-9]\d* ops on the quantized wire, [1-9]\d* relays", out), out


@pytest.mark.timeout(300)
def test_transports_small_run_checks_every_transport():
    """benchmarks/transports.py end to end at a tiny size (4 worker processes): the hand-written
    floor, "memory" and "group" each timed and checked (the floor element by element against the layout, the others bit for bit against it),
    the paired ratios printed with their intervals."""
    proc = _run("benchmarks/transports.py", "--small", "--rows", "256", "--cols", "512", "--rounds", "6",
                "--methods", "floor,memory,group")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = proc.stdout
    for method in ("floor", "memory", "group"):
        assert re.search(rf"\n  {method} +median +[\d.]+ ms +[\d.]+ GiB/s  check: exact", out), out
    assert re.search(r"\n  memory / floor: [\d.]+ \(95 % interval [\d.]+-[\d.]+\)  target <= 1.25: ", out), out
    assert re.search(r"\n  group / memory: [\d.]+ \(95 % interval [\d.]+-[\d.]+\)  target >= 2.0: ", out), out


@pytest.mark.timeout(300)
def test_transports_between_jobs_small_run():
    """`--jobs`: a trainer job and 2 engine replicas (6 processes), TrainerJob/EngineJob on
    "memory", on "group" and (NIXL installed, as in CI) on "nixl" against the floor, each checked,
    the reports naming the transport."""
    proc = _run("benchmarks/transports.py", "--jobs", "--small", "--rows", "256", "--cols", "512", "--rounds", "6")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = proc.stdout
    nixl = importlib.util.find_spec("nixl") is not None or importlib.util.find_spec("nixl_cu12") is not None
    for method in ("floor", "jobs_memory", "jobs_group") + (("jobs_nixl",) if nixl else ()):
        assert re.search(rf"\n  {method} +median +[\d.]+ ms +[\d.]+ GiB/s  check: exact", out), out
    reports = re.search(r"the jobs' reports: (.*)\n", out).group(1)
    assert "'memory': {'r0': 'memory (cma)', 'r1': 'memory (cma)'}" in reports, out
    assert "'group': {'r0': 'group (gloo)', 'r1': 'group (gloo)'}" in reports, out
    assert ("'nixl': {'r0': 'nixl (UCX)', 'r1': 'nixl (UCX)'}" in reports) == nixl, out
    assert re.search(r"\n  jobs_memory / floor: [\d.]+ \(95 % interval [\d.]+-[\d.]+\)  target <= 1.25: ", out), out


@pytest.mark.timeout(300)
def test_flat_refit_tiny_run_checks_both_paths():
    """benchmarks/flat_refit.py at its tiny size (6 processes: a Llama under DeepSpeed ZeRO-3 on 4
    gloo ranks -> vLLM TP2 on 2): layoutlang from the ds_tensors and TRL's gather path each write
    every round what vLLM's rule makes of the gathered parameters, the paired ratio is printed
    with its interval, and the bytes beyond a rank's own shards are the hand-counted ones."""
    if not os.environ.get("LAYOUTLANG_CI"):
        pytest.importorskip("deepspeed")
        pytest.importorskip("transformers")
    proc = _run("benchmarks/flat_refit.py", "--size", "tiny", "--timeout", "200", timeout=260)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = proc.stdout
    for method in ("layoutlang", "layoutlang_gloo", "trl"):
        assert re.search(rf"\n  {method} +median +[\d.]+ ms +[\d.]+ GiB/s  check: exact, every round", out), out
    assert re.search(r"\n  layoutlang / trl: [\d.]+ \(95 % interval [\d.]+-[\d.]+\)\n", out), out
    assert "'layoutlang': {'4': 'memory (cma)', '5': 'memory (cma)'}" in out, out
    # By hand (V=37, H=16, F=24, 4 q heads / 2 kv heads of 4, 1 layer, bf16): each ZeRO-3 rank keeps
    # ceil(numel / 4) of every parameter: 148 + 148 (embedding, lm_head) + 4 (norm) + 64 + 32 + 32 + 64
    # (q, k, v, o) + 3 x 96 (gate, up, down) + 2 x 4 (layer norms) = 788 elements; an engine rank
    # 32 x 16 twice (vocabulary padded to 64, halved) + 16 + 16 x 16 (qkv) + 16 x 8 (o) + 24 x 16
    # (gate_up) + 16 x 12 (down) + 2 x 16 = 2032. The largest parameter, the embedding: 37 x 16.
    assert "(ZeRO-3 ranks hold 1576 B, engine ranks 4064 B)" in out, out
    assert re.search(r"\n    layoutlang +staging peak \d+ B \(budget 256 B;", out), out
    assert "trl             1184 B on every ZeRO-3 rank" in out and "1184 B on each engine rank" in out, out
    assert out.rstrip().endswith("result: ok")


@pytest.mark.timeout(60)
def test_gpu_transports_says_why_without_a_gpu():
    import torch

    proc = _run("benchmarks/gpu_transports.py")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    if not torch.cuda.is_available():
        assert "no CUDA device here" in proc.stdout, proc.stdout


@pytest.mark.timeout(300)
def test_refit_gloo_small_run_checks_every_method():
    """The gloo benchmark end to end at a tiny size (4 worker processes, two cases): every
    method's destinations checked (the table's last column), the pooled line printed, and
    exit 0 (the targets are for the default sizes only)."""
    proc = _run("benchmarks/refit_gloo.py", "--worlds", "4", "--tensors", "2", "--rows", "256", "--cols", "256",
                "--steps", "6", "--slow-steps", "1", "--cases", "tp4-tp2-d0,gtp", "--timeout", "200", timeout=280)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = proc.stdout
    rows = [line for line in out.splitlines() if line.startswith(("| TP4 -> TP2, dim 0 |", "| TP2 x GTP2 -> TP2,"))]
    assert len(rows) == 2 and all(line.endswith("| ok |") for line in rows), out
    assert re.search(r"\nall 2 cases pooled, 12 rounds, median of the paired ratios: layoutlang/hand \d\.\d{3} "
                     r"\(95 % interval \d\.\d{3}-\d\.\d{3}\); hand again/hand", out), out
    assert out.rstrip().endswith("result: ok")


@pytest.mark.timeout(300)
def test_plan_scale_quick():
    proc = _run("benchmarks/plan_scale.py", "--quick", "--repeat", "1")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = proc.stdout
    for pattern in (
        r"busiest sender lower bound, from the layouts alone: \d+\.\d{3}x floor",
        r"naive vs templates pieces \(dst rank, name, slice\) on every tensor: IDENTICAL",
        r"\nratios \(targets are for the full size; --quick is a smoke run\):\n",
        r"\n  naive / templates, planning time \(compile \+ ops, load excluded\): \d+x \(>= 20x\)",
        r"\n  one rank's plan: [\d.]+ s wall, [\d.]+ s CPU \(< 2 s\) ",
        r"\n  full plan: [\d.]+ s wall, [\d.]+ s CPU \(< 60 s\) ",
        r"\n  memory: [\d.]+ GiB \(< 4 GiB\) ",
        r"\n  round robin busiest sender / balanced: ",
        r"\nresult: ok\n",
    ):
        assert re.search(pattern, out), f"missing {pattern!r} in\n{out}"
    assert "WRONG" not in proc.stderr


def test_naive_compare_fails_when_it_cannot_see_candidates():
    """The comparison used to swallow AttributeError: a renamed planner internal skipped it."""
    import naive_planner
    from layoutlang import loads
    from layoutlang.compiler import compile_plan

    src = loads("mesh s (dp=2, tp=2)\ntensor w [8 over tp, 4]\n", "s.layout")
    dst = loads("mesh d (tp=1) at 4\ntensor w [8, 4]\n", "d.layout")
    real, naive = compile_plan(src, dst), naive_planner.NaivePlan(src, dst)
    naive_planner._DST_CACHE[:] = naive_planner.dst_items(dst)
    assert naive_planner.compare(real, naive) == []

    class Hidden:  # the real plan without its internals
        def __init__(self, plan):
            self.ops, self.src = plan.ops, plan.src

    with pytest.raises(AttributeError, match="transfers"):  # never swallowed, never skipped
        naive_planner.compare(Hidden(real), naive)


def test_layout_lower_bound_by_hand():
    """[8 over tp, 4] bf16 on dp=2 x tp=2 -> [8, 4] on rank 4: rows 0-3 (16 elements, 32 B) are
    held by ranks {0, 2} (tp 0), rows 4-7 by {1, 3}: 32 B must leave each pair, so some rank
    sends at least 16 B; 64 B in all from 4 usable senders."""
    import plan_scale
    from layoutlang import loads

    src = loads("mesh s (dp=2, tp=2)\ntensor w [8 over tp, 4]\n", "s.layout")
    dst = loads("mesh d (tp=1) at 4\ntensor w [8, 4]\n", "d.layout")
    held = plan_scale.layout_holders(src, dst)
    assert held["by_set"] == {frozenset({0, 2}): 32, frozenset({1, 3}): 32}
    assert held["bytes"] == 64 and held["usable"] == [0, 1, 2, 3]
    assert plan_scale.send_lower_bound(held["by_set"]) == 16
    # collocated on rank 0: rank 0 holds rows 0-3 itself (a local copy, no link); rows 4-7 from {1, 3}
    # (an mxfp8 destination travels as bf16: 4 x 32 elements x 2 B = 256 B per half)
    src32 = loads("mesh s (dp=2, tp=2)\ntensor w [8 over tp, 32]\n", "s.layout")
    dst0 = loads("mesh d (tp=1)\ntensor w [8, 32] mxfp8\n", "d.layout")
    held = plan_scale.layout_holders(src32, dst0)
    assert held["by_set"] == {frozenset({1, 3}): 256} and held["bytes"] == 512
    # a rank that holds everything only it holds: the bound is all of it
    assert plan_scale.send_lower_bound({frozenset({5}): 100, frozenset({5, 6}): 40}) == 100
    # overlapping groups: {0,1} and {1,2} joined hold 90 B over 3 ranks
    assert plan_scale.send_lower_bound({frozenset({0, 1}): 40, frozenset({1, 2}): 50}) == 30


def test_refit_gloo_reports_missed_targets():
    import refit_gloo

    row = {"case": "tp4-tp2-d0", "ms": {"naive": 30.0, "layoutlang": 20.0, "hand_p2p": 10.0}}
    missed = refit_gloo.missed_targets(row)
    assert len(missed) == 2 and "1.50x < 2.0x" in missed[0] and "2.000x > 1.0x" in missed[1]
    # a miss by less than the table's old two digits still shows: 10.04 / 10.0
    close = refit_gloo.missed_targets({"case": "gtp", "ms": {"naive": 30.0, "layoutlang": 10.04, "hand_p2p": 10.0}})
    assert close == ["layoutlang/hand 1.004x > 1.0x"]


def test_refit_gloo_pairs_steps_by_round():
    """Paired: the median of per-round ratios. Hand-computed: rounds (2/1, 3/3, 8/4) -> 1.0, 2.0, 2.0."""
    import refit_gloo

    assert refit_gloo._paired([2.0, 3.0, 8.0], [1.0, 3.0, 4.0]) == 2.0
    # a load drift that doubles both methods' steps halfway cancels in the pairs, not in the medians
    base, other = [1.0, 1.0, 2.0, 2.0, 2.0], [1.1, 1.1, 2.2, 2.2, 2.2]
    assert abs(refit_gloo._paired(other, base) - 1.1) < 1e-12
    assert refit_gloo._paired([], []) is None
    assert refit_gloo.missed_targets({"case": "gtp", "ms": {"naive": 30.0, "layoutlang": 10.0,
                                                            "hand_p2p": 10.0}}) == []


def test_refit_gloo_pools_every_round_of_every_case():
    """Two cases of 3 rounds each pool into 6 ratios; sorted 0.9, 0.95, 1.0, 1.0, 1.05, 1.1: the
    median is 1.0 and, for n = 6, the 95 % interval is the whole range (see the test above)."""
    import refit_gloo

    rows = [{"paired_ratios": {"layoutlang": [1.0, 0.9, 1.1], "hand_again": [1.0] * 3}},
            {"paired_ratios": {"layoutlang": [1.05, 0.95, 1.0], "hand_again": [0.98, 1.0, 1.02]}}]
    assert refit_gloo.pooled(rows) == (
        "all 2 cases pooled, 6 rounds, median of the paired ratios: layoutlang/hand 1.000 (95 % interval "
        "0.900-1.100); hand again/hand 1.000 (95 % interval 0.980-1.020)")
    assert refit_gloo.pooled(rows[:1]) is None  # 3 rounds: too few for a 95 % interval


def test_refit_gloo_balances_the_order_of_the_methods():
    """A Williams design (its definition, checked here): over n rounds (2n for odd n) every
    method takes every position equally often and every ordered pair of methods is adjacent
    equally often; across rounds no method runs twice in a row."""
    import refit_gloo

    for n in (4, 5, 6):
        methods = [f"m{k}" for k in range(n)]
        rows = [refit_gloo.round_order(methods, i) for i in range(n if n % 2 == 0 else 2 * n)]
        per = len(rows) // n
        assert all(sorted(r) == methods for r in rows)
        for pos in range(n):
            assert Counter(r[pos] for r in rows) == {m: per for m in methods}
        pairs = Counter((r[j], r[j + 1]) for r in rows for j in range(n - 1))
        assert pairs == {(a, b): per for a in methods for b in methods if a != b}
        # 25 timed rounds, each started after the previous round's last method
        last, seq = None, []
        for i in range(26):
            row = refit_gloo.round_order(methods, i, last)
            seq += row
            last = row[-1]
        assert all(a != b for a, b in zip(seq, seq[1:]))
    # row 1 of n = 4 by hand: row 0 is 0, 1, 3, 2; plus 1 is 1, 2, 0, 3 (d ran last: no turn needed)
    assert refit_gloo.round_order(["a", "b", "c", "d"], 1, "d") == ["b", "c", "a", "d"]
    assert refit_gloo.round_order(["a"], 3, "a") == ["a"]


def test_refit_gloo_interval_of_the_paired_median():
    """Order statistics: for n = 25 the binomial tail P(Bin(25, 1/2) <= 7) = 0.0216 <= 0.025 and
    P(<= 8) = 0.0539, so the 95 % interval is the 8th to the 18th smallest; for n = 6 it is the
    whole range (P(0) = 1/64, P(<= 1) = 7/64); for n = 5, P(0) = 1/32 > 0.025: none."""
    import refit_gloo

    assert refit_gloo._median_interval([float(x) for x in range(25, 0, -1)]) == (8.0, 18.0)
    assert refit_gloo._median_interval([6.0, 5.0, 4.0, 3.0, 2.0, 1.0]) == (1.0, 6.0)
    assert refit_gloo._median_interval([1.0, 2.0, 3.0, 4.0, 5.0]) is None
    row = {"case": "gtp", "ms": {"naive": 30.0, "layoutlang": 10.2, "hand_p2p": 10.0},
           "paired": {"layoutlang": 1.01, "hand_again": 0.99},
           "paired_interval": {"layoutlang": (0.98, 1.03), "hand_again": (0.97, 1.02)}}
    assert refit_gloo.missed_targets(row) == [
        "layoutlang/hand 1.020x > 1.0x; layoutlang/hand paired 1.010, 95 % interval of its median 0.980-1.030; "
        "hand again/hand paired 0.990, 95 % interval of its median 0.970-1.020"]


# ---------------------------------------------------------------------------
# Doctests of layoutlang/compiler/ and layoutlang/runtime/


def _modules() -> list[str]:
    import layoutlang.compiler
    import layoutlang.runtime

    names = []
    for pkg in (layoutlang.compiler, layoutlang.runtime):
        names.append(pkg.__name__)
        names += [f"{pkg.__name__}.{m.name}" for m in pkgutil.iter_modules(pkg.__path__)]
    return sorted(names)


def _doctests(name: str) -> list[doctest.DocTest]:
    module = importlib.import_module(name)
    return [t for t in doctest.DocTestFinder().find(module, name) if t.examples]


MODULES = _modules()


def test_doctests_exist():
    """pytest runs these doctests where it runs every other package's (`--doctest-modules` over
    layoutlang/, pyproject.toml): the two packages hold some (a move that hid them would find none)."""
    found = {name: sum(len(t.examples) for t in _doctests(name)) for name in MODULES}
    assert found["layoutlang.compiler.ranks"] >= 1 and found["layoutlang.runtime.fill"] >= 1, found


# ---------------------------------------------------------------------------
# docs/cli.md and README.md


def sessions(text: str) -> list[list[tuple[str, str]]]:
    """Fenced blocks whose first line starts with `$ `: [(command, text up to the next `$`)]."""
    out = []
    for block in re.findall(r"^```[^\n]*\n(.*?)^```", text, re.M | re.S):
        if not block.startswith("$ "):
            continue
        steps: list[tuple[str, str]] = []
        for line in block.splitlines(keepends=True):
            if line.startswith("$ "):
                steps.append((line[2:].strip(), ""))
            else:
                steps[-1] = (steps[-1][0], steps[-1][1] + line)
        out.append(steps)
    return out


CLI_SESSIONS = sessions((ROOT / "docs" / "cli.md").read_text("utf-8"))


def _play(steps, tmp_path, monkeypatch, capsys) -> None:
    from layoutlang.cli import main

    (tmp_path / "examples").symlink_to(ROOT / "examples")
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("COLUMNS", raising=False)
    checker = doctest.OutputChecker()
    for command, expected in steps:
        argv = shlex.split(command)
        if argv[0] == "cat":
            (tmp_path / argv[1]).write_text(expected, "utf-8")
            continue
        assert argv[0] == "layoutc", f"docs/cli.md runs only `layoutc` and `cat`: {command}"
        capsys.readouterr()
        code = main(argv[1:])
        captured = capsys.readouterr()
        got = captured.out + captured.err
        assert checker.check_output(expected, got, doctest.ELLIPSIS), (
            f"`$ {command}` (exit {code}) printed:\n{got}\nbut docs/cli.md shows:\n{expected}")
        assert code == (1 if "error:" in expected else 0), f"`$ {command}` exited {code}"


@pytest.mark.timeout(240)
@pytest.mark.parametrize("index", range(len(CLI_SESSIONS)),
                         ids=[s[-1][0][:60] for s in CLI_SESSIONS])
def test_cli_doc_sessions(index, tmp_path, monkeypatch, capsys):
    _play(CLI_SESSIONS[index], tmp_path, monkeypatch, capsys)


def test_cli_doc_has_sessions():
    commands = [c for s in CLI_SESSIONS for c, _ in s]
    assert len(CLI_SESSIONS) >= 6 and sum(c.startswith("layoutc plan") for c in commands) >= 3, commands


def _readme_commands() -> list[str]:
    text = (ROOT / "README.md").read_text("utf-8")
    found = re.findall(r"^\$ \.venv/bin/(layoutc [^\n]+)$", text, re.M)
    return [re.sub(r"\s*\[[^\]]*\]", "", c) for c in found]


README = _readme_commands()


@pytest.mark.timeout(240)
@pytest.mark.parametrize("command", [c for c in README if not c.startswith("layoutc run ")])
def test_readme_commands_run(command, monkeypatch, capsys):
    from layoutlang.cli import main

    monkeypatch.chdir(ROOT)
    code = main(shlex.split(command)[1:])
    captured = capsys.readouterr()
    assert code == 0, captured.out + captured.err
    if not command.startswith("layoutc fmt"):  # fmt --check is silent when nothing would change
        assert captured.out, "a documented command printed nothing"


def test_readme_lists_the_verbs():
    verbs = {c.split()[1] for c in README}
    assert verbs == {"check", "fmt", "plan", "explain", "run", "new"}, README
