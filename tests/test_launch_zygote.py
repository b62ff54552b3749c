"""layoutlang/runtime/launch.py forks workers from a zygote (layoutlang/runtime/zygote.py): each must be what a fresh
`python PROGRAM JOB OUT` / `python -m layoutlang.runtime.worker JOB OUT` is.

The reference is the spawn path (`LAYOUTLANG_LAUNCH=spawn`, a fresh interpreter per
worker), run in the same test: the same refit results, and for a probe program the same
view of its world (argv, working folder, environment, its own session, stderr captured,
its exit code), except the numbers that differ by nature (pids).
"""

import json

import pytest

from layoutlang.runtime import launch as launch_module
from layoutlang.runtime.launch import launch

PROBE = '''
import json, os, sys
job, out = sys.argv[1], sys.argv[2]
print("probe stderr", os.environ["RANK"], file=sys.stderr)
with open(out, "w") as fh:
    json.dump({"ok": True, "argv0": os.path.basename(sys.argv[0]), "job": json.load(open(job)),
               "cwd": os.getcwd(), "extra": os.environ.get("PROBE_EXTRA"), "own_session": os.getsid(0) == os.getpid(),
               "path0": sys.path[0] == os.path.dirname(os.path.abspath(sys.argv[0])), "name": __name__}, fh)
sys.exit(int(os.environ["RANK"]) * 3)  # rank 1 exits 3
'''


def _probe(tmp_path, monkeypatch, mode: str):
    monkeypatch.setenv("LAYOUTLANG_LAUNCH", mode)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "probe.py").write_text(PROBE)
    results = launch({"x": 1}, 2, timeout=60, env={"PROBE_EXTRA": "yes"}, program=str(tmp_path / "probe.py"))
    return [(r.returncode, r.result, r.stderr.strip()) for r in results]


@pytest.mark.timeout(120)
def test_a_forked_program_sees_what_a_fresh_interpreter_sees(tmp_path, monkeypatch):
    spawned = _probe(tmp_path, monkeypatch, "spawn")
    assert spawned[0][0] == 0 and spawned[1][0] == 3
    assert spawned[0][1] == {"ok": True, "argv0": "probe.py", "job": {"x": 1}, "cwd": str(tmp_path), "extra": "yes",
                             "own_session": True, "path0": True, "name": "__main__"}
    assert [s for _, _, s in spawned] == ["probe stderr 0", "probe stderr 1"]
    assert _probe(tmp_path, monkeypatch, "zygote") == spawned
    assert launch_module._ZYGOTE is not None and launch_module._ZYGOTE.alive()  # it served


@pytest.mark.timeout(180)
def test_a_refit_through_the_zygote_equals_one_through_fresh_interpreters(tmp_path, monkeypatch):
    (tmp_path / "src.layout").write_text("mesh m (r=2)\ntensor w [8 over r, 64] fp32\ntensor b [6] bf16\n")
    (tmp_path / "dst.layout").write_text("mesh m (r=2)\ntensor w [8, 64 over r] mxfp8\ntensor b [6] fp32\n")
    job = {"src": str(tmp_path / "src.layout"), "dst": str(tmp_path / "dst.layout"), "verify": True}
    keys = ("ok", "check_errors", "checked_tensors", "sent_bytes", "received_bytes", "local_bytes")
    out = {}
    for mode in ("spawn", "zygote"):
        monkeypatch.setenv("LAYOUTLANG_LAUNCH", mode)
        out[mode] = [(r.returncode, {k: r.result[k] for k in keys}) for r in launch(job, 2, timeout=90)]
    assert out["spawn"] == out["zygote"]
    assert [code for code, _ in out["zygote"]] == [0, 0] and all(res["ok"] for _, res in out["zygote"])


@pytest.mark.timeout(120)
def test_a_worker_past_its_deadline_is_killed_and_reported_as_such(tmp_path, monkeypatch):
    monkeypatch.setenv("LAYOUTLANG_LAUNCH", "zygote")
    (tmp_path / "sleep.py").write_text("import time\ntime.sleep(600)\n")
    results = launch({}, 2, timeout=3, program=str(tmp_path / "sleep.py"))
    assert [r.returncode for r in results] == [None, None]  # killed at the deadline, as a Popen's would be
    assert json.dumps([r.result for r in results]) == "[null, null]"


@pytest.mark.timeout(120)
def test_a_launch_from_a_thread_that_ends_keeps_the_zygote(tmp_path, monkeypatch):
    """Linux fires a child's parent-death signal when the THREAD that started it exits: a zygote
    started by a launch in a short-lived thread (a ThreadPoolExecutor's) must outlive that thread,
    so the next launch, from any thread, is served by the same zygote."""
    import threading
    import time

    monkeypatch.setenv("LAYOUTLANG_LAUNCH", "zygote")
    (tmp_path / "ok.py").write_text("import json, sys\njson.dump({'ok': True}, open(sys.argv[2], 'w'))\n")
    with launch_module._ZYGOTE_LOCK:  # a fresh zygote, started from the thread below
        if launch_module._ZYGOTE is not None:
            launch_module._ZYGOTE.proc.kill()
            launch_module._ZYGOTE.proc.wait()
    thread = threading.Thread(target=lambda: launch({}, 1, timeout=60, program=str(tmp_path / "ok.py")))
    thread.start()
    thread.join()
    zygote = launch_module._ZYGOTE
    time.sleep(0.5)  # (the signal, had it been armed to that thread, is delivered by now)
    assert zygote.alive()
    assert all(r.ok for r in launch({}, 1, timeout=60, program=str(tmp_path / "ok.py")))
    assert launch_module._ZYGOTE is zygote
