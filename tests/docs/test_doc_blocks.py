"""Every code block of README.md and docs/*.md runs or is checked here, so the documentation
cannot drift from the code (the markers are described in doc_blocks.py and CONTRIBUTING.md).

A ``python`` block runs as a script in a fresh interpreter, in an empty folder, and passes when
it exits 0 within the timeout; the blocks assert what they show. Blocks that import MegEngine
are parametrized ``framework="megengine"``, so tests/conftest.py deselects them where MegEngine
is not installed (.venv-latest).
"""

from __future__ import annotations

import warnings

import pytest
from doc_blocks import (
    MARKERS,
    RUN,
    all_blocks,
    outputs,
    printed_as_shown,
    read,
    run_block,
    unified_diff,
)

BLOCKS = all_blocks()
OUTPUTS = outputs()  # the output a page shows after a block, by the block's id


@pytest.mark.slow
@pytest.mark.parametrize("framework, block", [pytest.param(b.framework, b, id=b.id) for b in RUN])
def test_block_runs(framework: str, block, tmp_path) -> None:
    if framework != "core":
        pytest.importorskip(framework, reason=f"{framework} is not installed in this environment")
    run_block(block, tmp_path)


QUICK_STARTS = ["README.md", "docs/index.md"]


def test_every_quick_start_shows_what_it_prints() -> None:
    """A newcomer sees that the quick start worked: each python block of README.md's quick
    starts, and the first of Getting started, prints, and the page shows what (a test
    above compares)."""
    readme = [b for b in RUN if b.path == "README.md"]
    first = next(b for b in RUN if b.path == "docs/index.md")
    assert len(readme) >= 3
    for block in [*readme, first]:
        assert "print(" in block.text and block.id in OUTPUTS, block.id


def test_output_comparison_can_fail() -> None:
    shown = "step 0  loss 2.0000\nstep 1  loss 1.0000\n"
    assert printed_as_shown("banner\nstep 0  loss 2.0001\nstep 1  loss 1.0004\n", shown) == []
    assert printed_as_shown("step 0  loss 2.0000\n", shown) != []  # a line missing
    assert printed_as_shown("step 0  loss 2.0000\nstep 1  loss 1.1000\n", shown) != []
    assert printed_as_shown("step 0  loss 1.0000\nstep 1  loss 2.0000\n",
                            "step 0  loss 1.0000\nstep 1  loss 2.0000\n") != []  # goes up


def test_there_are_blocks_to_run() -> None:
    """The parser finds the blocks (a broken fence pattern would make every test vanish)."""
    assert len(RUN) >= 15, [b.id for b in RUN]
    assert sum(b.marker == "2 ranks" for b in RUN) >= 3


@pytest.mark.parametrize("block", [pytest.param(b, id=b.id) for b in BLOCKS if b.marker])
def test_marker_is_known(block) -> None:
    assert MARKERS.match(block.marker), f"{block.id}: unknown test marker {block.marker!r}"
    if block.marker.startswith("diff "):
        assert block.lang == "diff", f"{block.id}: a 'diff' marker on a {block.lang} block"


@pytest.mark.parametrize("block", [pytest.param(b, id=b.id) for b in BLOCKS
                                   if b.marker.startswith("same as ")])
def test_block_is_the_file(block) -> None:
    """The block shows a file that another test runs; it must be that file, character for
    character."""
    path = block.marker[len("same as "):]
    assert block.text == read(path), f"{block.id} differs from {path}: copy the file in again"


@pytest.mark.parametrize("block", [pytest.param(b, id=b.id) for b in BLOCKS
                                   if b.marker.startswith("diff ")])
def test_diff_block_is_generated(block) -> None:
    a, b = block.marker.split()[1:]
    expected = unified_diff(a, b)
    assert block.text == expected, (
        f"{block.id} is not `diff -u {a} {b}` any more; replace the block with:\n{expected}")


def test_skipped_blocks_are_few_and_say_why() -> None:
    """Each block that does not run shows in the warnings summary with its reason."""
    skipped = [b for b in BLOCKS if b.marker.startswith("skip")]
    for b in skipped:
        warnings.warn(f"{b.id} does not run: {b.marker}", UserWarning, stacklevel=1)
    python = [b for b in BLOCKS if b.lang == "python"]
    assert len(skipped) <= len(python) // 10, [b.id for b in skipped]
