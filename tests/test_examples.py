"""Every shipped example checks clean and is already in canonical style."""

from pathlib import Path

import pytest

from layoutlang import load
from layoutlang.cli import main

EXAMPLES = sorted((Path(__file__).parent.parent / "examples").glob("*.layout"))


def test_examples_exist():
    assert len(EXAMPLES) >= 6


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
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
