"""Layouts that `include` other files are refused where a job must send its layout as one text.

A trainer job publishes its layout to the engine jobs as text, and an engine replica whose
args change publishes its layout again: both need the layout's whole text in one file, so a
layout that includes another is refused with a message saying which file and why
(layoutlang/runtime/jobs.py), before anything is published. The expected messages are written out here
from that rule. (The third such refusal, `EngineJob.layout` planning for other args, is not
covered here.)
"""

from datetime import timedelta

import pytest
import torch.distributed as dist

from layoutlang import load
from layoutlang.diagnostics import UsageError
from layoutlang.runtime import EngineJob, TrainerJob

COMMON = "tensor emb [8, 4]\n"
MAIN = 'arg N = 1\nmesh x (ep=1)\ninclude "common.layout"\ntensor w [4, 4]\n'
PLAIN = "arg N = 1\nmesh x (ep=1)\ntensor emb [8, 4]\ntensor w [4, 4]\n"


@pytest.fixture
def layouts(tmp_path):
    (tmp_path / "common.layout").write_text(COMMON)
    (tmp_path / "main.layout").write_text(MAIN)
    (tmp_path / "plain.layout").write_text(PLAIN)
    return tmp_path


def _kw():
    return dict(store=dist.HashStore(), timeout=timedelta(seconds=5))


@pytest.mark.timeout(60)
def test_trainer_job_refuses_an_including_layout(layouts):
    main = load(str(layouts / "main.layout"))
    assert len(main.sources) == 2  # the include was read: the layout is two files
    with pytest.raises(UsageError) as err:
        TrainerJob(main, load(str(layouts / "plain.layout")), rank=0, world_size=1, **_kw())
    assert str(err.value).splitlines()[0].endswith(
        f"{main.path} includes other files: a trainer layout travels to the engines as one text, so write it "
        "without `include` for a refit between jobs")


@pytest.mark.timeout(60)
def test_engine_set_args_refuses_an_including_layout(layouts):
    main = load(str(layouts / "main.layout"))
    job = EngineJob(main, replica="A", rank=0, world_size=1, **_kw())
    with pytest.raises(UsageError) as err:
        job.set_args({"N": 2})
    assert str(err.value).splitlines()[0].endswith(
        f"{main.path} includes other files: a replica whose args change publishes its layout as one text, "
        "so write it without `include`")
    assert job.one is main  # nothing changed: the replica keeps its layout


@pytest.mark.timeout(60)
def test_engine_set_args_on_a_plain_layout_takes_the_args(layouts):
    plain = load(str(layouts / "plain.layout"))
    job = EngineJob(plain, replica="A", rank=0, world_size=1, **_kw())
    job.set_args({"N": 2})
    assert dict(job.one.args)["N"] == 2
