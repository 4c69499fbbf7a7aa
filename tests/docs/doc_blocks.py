"""The fenced code blocks of README.md, CONTRIBUTING.md and docs/*.md, with the test marker
before each.

A block opens with a fence at the start of a line (```` ```python ````) and closes with
```` ``` ````. An HTML comment on the line before it says how it is tested (CONTRIBUTING.md):

* none: a ``python`` block runs as a script in a fresh interpreter;
* ``<!-- test: 2 ranks -->``: it runs under ``torchrun --nproc_per_node 2`` (gloo);
* ``<!-- test: skip (reason) -->``: it does not run (a fragment); the reason is required;
* ``<!-- test: same as PATH -->``: it must equal the file PATH, which a test runs;
* ``<!-- test: diff A B -->`` (a ``diff`` block): it must equal ``diff -u A B``, generated;
* ``<!-- test: output -->`` (a ``text`` block): what the ``python`` block before it prints
  (``printed_as_shown``: the same lines, numbers to 1e-3).
"""

# Hand-written, not sybil (sybil 10.1.0, measured 2026-11-28, issue 37): sybil runs a python
# block with exec() in a namespace shared by the page, in this process. A fresh interpreter in
# an empty folder, torchrun for "2 ranks", the output comparison and "same as"/"diff" each need
# a custom parser and evaluator (a 41-line prototype ran README.md's blocks that way); sybil then
# replaces only blocks()' fence scan, and its lexer also takes fences indented in lists and
# quotes, which our rule (a fence at the start of a line) leaves out. Its items
# (README.md::line:101,column:1) have no `framework` parameter, so tests/conftest.py's MegEngine
# deselection and test_packaging.py's run of the same blocks against the installed wheel would
# need rework.
from __future__ import annotations

import difflib
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional

from docs_helpers import ROOT, run, torchrun

_OPEN = re.compile(r"^```([\w-]*)\s*$")
_MARKER = re.compile(r"^<!--\s*test:\s*(.*?)\s*-->\s*$")
MARKERS = re.compile(r"^(2 ranks|skip \(.+\)|same as \S+|diff \S+ \S+|output)$")


@dataclass
class Block:
    path: str  # relative to the repository root
    line: int  # of the opening fence, 1-based
    lang: str
    text: str
    marker: str  # what follows "test:" in the comment before the block, or ""

    @property
    def id(self) -> str:
        return f"{self.path}:{self.line}"

    @property
    def framework(self) -> str:
        """The framework the block needs: ``paddle``, ``megengine``, ``torch``, or ``core``
        (Paddle's blocks run in .venv-paddle, which also has the other two)."""
        if re.search(r"^\s*(import|from) paddle\b", self.text, re.MULTILINE):
            return "paddle"
        if re.search(r"^\s*(import|from) megengine\b", self.text, re.MULTILINE):
            return "megengine"
        if re.search(r"^\s*(import|from) torch\b", self.text, re.MULTILINE):
            return "torch"
        return "core"


def doc_files() -> List[str]:
    """README.md, CONTRIBUTING.md and every Markdown file under docs/, relative to the root."""
    found = ["README.md", "CONTRIBUTING.md"]
    for folder, _, names in sorted(os.walk(os.path.join(ROOT, "docs"))):
        found += sorted(os.path.relpath(os.path.join(folder, n), ROOT)
                        for n in names if n.endswith(".md"))
    return found


def blocks(path: str) -> List[Block]:
    """The fenced blocks of ``path`` (relative to the root), in order."""
    with open(os.path.join(ROOT, path), encoding="utf-8") as f:
        lines = f.read().splitlines()
    found, i = [], 0
    while i < len(lines):
        match = _OPEN.match(lines[i])
        if not match:
            i += 1
            continue
        end = next((j for j in range(i + 1, len(lines)) if lines[j].rstrip() == "```"), None)
        if end is None:
            raise ValueError(f"{path}:{i + 1}: a code block that never closes")
        before = lines[i - 1] if i else ""
        marker = _MARKER.match(before)
        found.append(Block(path, i + 1, match.group(1), "\n".join(lines[i + 1:end]) + "\n",
                           marker.group(1) if marker else ""))
        i = end + 1
    return found


def all_blocks() -> List[Block]:
    return [b for path in doc_files() for b in blocks(path)]


def outputs() -> Dict[str, Block]:
    """The ``output`` blocks, by the id of the python block each shows the output of."""
    found = {}
    for path in doc_files():
        found_here = blocks(path)
        for before, block in zip(found_here, found_here[1:]):
            if block.marker == "output":
                if before.lang != "python" or block.lang != "text":
                    raise ValueError(f"{block.id}: an output block must be a text block "
                                     f"after a python block")
                found[before.id] = block
    return found


def _number(token: str) -> Optional[float]:
    try:
        return float(token)
    except ValueError:
        return None


def printed_as_shown(printed: str, shown: str) -> List[str]:
    """What differs between what a block printed and the output the page shows (nothing: an
    empty list). Printed lines are read where their first word starts a shown line (a
    framework's banner is not the block's); words must be equal, numbers within 1e-3
    relative (another release of a framework may round the last digit differently), and
    where a line says ``loss``, the losses must go down."""
    want = [line.split() for line in shown.splitlines() if line.strip()]
    starts = {words[0] for words in want}
    got = [line.split() for line in printed.splitlines() if line.split()[:1]
           and line.split()[0] in starts]
    if len(got) != len(want):
        return [f"printed {len(got)} lines, the page shows {len(want)}: {printed!r}"]
    problems = []
    for g, w in zip(got, want):
        same = len(g) == len(w) and all(
            a == b or (_number(a) is not None and _number(b) is not None
                       and abs(_number(a) - _number(b)) <= 1e-3 * max(1.0, abs(_number(b))))
            for a, b in zip(g, w))
        if not same:
            problems.append(f"printed {' '.join(g)!r}, the page shows {' '.join(w)!r}")
    losses = [_number(words[-1]) for words in got if "loss" in words]
    if any(b is None or a is None or b >= a for a, b in zip(losses, losses[1:])):
        problems.append(f"the loss does not go down: {losses}")
    return problems


def unified_diff(a: str, b: str) -> str:
    """``diff -u a b`` of two files (paths relative to the root), without timestamps."""
    return "".join(difflib.unified_diff(read(a).splitlines(keepends=True),
                                        read(b).splitlines(keepends=True), fromfile=a, tofile=b))


def read(path: str) -> str:
    """The text of ``path``, relative to the root."""
    with open(os.path.join(ROOT, path), encoding="utf-8") as f:
        return f.read()


RUN = [b for b in all_blocks() if b.lang == "python" and b.marker in ("", "2 ranks")]
ONE_RANK_TIMEOUT_S, TWO_RANKS_TIMEOUT_S = 120, 180


def run_block(block: Block, folder: Path, python: str = sys.executable,
              **env: str) -> subprocess.CompletedProcess:
    """Run a ``python`` block as a script in ``folder`` (empty) with ``python``, on 2 ranks
    where its marker says so; fail unless it exits 0 within the timeout and prints what the
    page's output block after it shows (if there is one). ``env`` is added to the script's
    environment (tests/docs/test_packaging.py empties PYTHONPATH to run the installed copy)."""
    script = folder / "block.py"
    script.write_text(block.text, encoding="utf-8")
    if block.marker == "2 ranks":
        # The pages' 2-rank examples run on CPU over gloo; CUDA hidden, as on the machines
        # they are written for (torch's powerSGD_hook calls torch.cuda.synchronize on a CPU
        # tensor's device wherever CUDA is available: DDP's run fails there too).
        done = run(torchrun(str(script), python=python), TWO_RANKS_TIMEOUT_S, cwd=str(folder),
                   CUDA_VISIBLE_DEVICES="", **env)
    else:
        done = run([python, str(script)], ONE_RANK_TIMEOUT_S, cwd=str(folder), **env)
    shown = outputs().get(block.id)
    if shown is not None:
        problems = printed_as_shown(done.stdout, shown.text)
        assert not problems, f"{block.id} prints other than {shown.id} shows: {problems}"
    return done
