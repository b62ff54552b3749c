"""tests/shared_launch.py: several refit jobs in one launch give what launches of their own give.

The runtime tests share launches to save process start-ups; a shared launch must
never turn a failure into a pass or hide a case. Here, on 2 gloo ranks with a
[8, 4] fp32 tensor resharded from rows to columns (each rank sends a quarter): a
good case, a case that corrupts a transfer under `verify` (a rank reports the
verification failure), and a good case after it. The launch stops after the failure
(a case never runs in a group a fault may have left behind), so the third case is
not reached there, and `SharedLaunches` runs it alone, where it passes.
"""

import pytest

from shared_launch import SharedLaunches, launch_cases

SRC = "layout rows\nmesh m (r=2)\ntensor w [8 over r, 4] fp32\n"
DST = "layout cols\nmesh m (r=2)\ntensor w [8, 4 over r] fp32\n"


@pytest.fixture()
def jobs(tmp_path):
    (tmp_path / "src.layout").write_text(SRC)
    (tmp_path / "dst.layout").write_text(DST)
    base = {"src": str(tmp_path / "src.layout"), "dst": str(tmp_path / "dst.layout"), "verify": True, "timeout": 20}
    return [("good", base), ("corrupt", {**base, "corrupt": {"rank": 0}}), ("after", base)]


@pytest.mark.timeout(240)
def test_a_failed_case_stops_the_shared_launch_and_the_rest_run_alone(jobs):
    got = launch_cases(jobs, 2, timeout=120)
    assert [r.ok for r in got["good"]] == [True, True]
    assert got["good"][0].result["sent_bytes"] == 4 * 2 * 4  # rank 0's rows 0-3, columns 2-3: 8 fp32
    assert not all(r.ok for r in got["corrupt"])
    assert any("verification failed" in (r.error or "") for r in got["corrupt"]), [r.error for r in got["corrupt"]]
    assert got["after"] is None  # not run after a failure
    shared = SharedLaunches({"2": (2, jobs)}, {"after"}, timeout_per_case=30, alone_timeout=120)
    results = shared.results_for("after")
    assert [r.ok for r in results] == [True, True] and shared.where["after"] == "in a launch of its own (2 ranks)"
