"""Every shipped example checks clean and is already in canonical style."""

from pathlib import Path

import pytest

from layoutlang import load
from layoutlang.cli import main

EXAMPLES = sorted((Path(__file__).parent.parent / "examples").glob("*.layout"))
# Language v2 (keys inside stored tensors): checked here, not planned until the compiler plans them
V2_EXAMPLES = sorted((Path(__file__).parent.parent / "examples" / "v2").glob("*.layout"))


def test_examples_exist():
    assert len(EXAMPLES) >= 6


def test_v2_examples_exist():
    assert len(V2_EXAMPLES) >= 3


@pytest.mark.parametrize("path", EXAMPLES + V2_EXAMPLES, ids=lambda p: p.name)
def test_example_checks_clean(path, capsys):
    assert main(["check", str(path)]) == 0, capsys.readouterr().err
    layout = load(path)
    assert layout.tensors, "an example with no tensors teaches nothing"
    # every tensor's runs answer on one rank that holds it, and cover its local shape
    for t in layout.tensors[:200]:
        rank = next(t.ranks())
        for runs, extent in zip(t.runs(rank), t.local_shape):
            assert sum(r.length for r in runs) == extent


def test_examples_are_formatted(capsys):
    assert main(["fmt", "--check", str(EXAMPLES[0].parent)]) == 0, capsys.readouterr().out
