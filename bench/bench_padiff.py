"""PaDiff (padiff 0.2.0) and gradmgr's parity tool on the same PyTorch -> Paddle ports: for each
case (the correct port and each of ``examples/porting/paddle_broken.PORTS``, ResNet-18 and the
BERT-style encoder), did the tool report a difference, which layer did it name, how long did the
check take, and did it say OK on a broken port (a false OK) or report a correct one (a false
alarm). Issue 40's table in docs/porting.md ("Side by side with PaDiff") comes from here.

Each tool runs in a process of its own (``--tool padiff`` / ``--tool gradmgr``, one JSON line
per case on stdout): importing padiff wraps torch's and Paddle's functions for the whole
process, which must not touch the other column. A check is the tool's whole check of one
training step on one batch (weights copied from the torch model, forward, cross-entropy loss,
backward, the comparison), timed with ``perf_counter``, once per case; building the models is
outside it. PaDiff runs three times: with its defaults (``compare_mode="mean"``, ``atol=0``,
``rtol=1e-7``), and with a per-element comparison (``compare_mode="strict"``) at two
tolerances, ``atol=1e-4, rtol=1e-3`` ("strict") and ``atol=1e-6, rtol=1e-4`` ("tight"): PaDiff
takes one tolerance for every tensor, and the mean of a tensor can agree while its elements do
not. PaDiff copies the weights itself (``auto_weights=True``), choosing by a layer's class name
which to transpose.

Without padiff installed, its column says "not installed". gradmgr's column calls
``gradmgr.parity.compare_step`` (the hook below, ``gradmgr_check``); until the Paddle adapter
lands it says "not run: <reason>".

    PYTHONPATH=$PWD python bench/bench_padiff.py [--cases NAME,...] [--json OUT]

Needs Paddle and torch in one Python (``GRADMGR_FRAMEWORKS`` is not read); padiff 0.2.0 for its
column (``pip install --no-deps padiff==0.2.0`` keeps numpy < 2).
"""

from __future__ import annotations

import argparse
import io
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from contextlib import redirect_stderr, redirect_stdout
from typing import Any, Dict, List, Optional, Tuple

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(ROOT, "examples"))

BATCH = 8
PADIFF_OPTIONS = {
    "default": {},  # compare_mode "mean", atol 0, rtol 1e-7
    "strict": {"compare_mode": "strict", "atol": 1e-4, "rtol": 1e-3},
    "tight": {"compare_mode": "strict", "atol": 1e-6, "rtol": 1e-4},
}


# ----------------------------------------------------------------------------- the cases
def cases() -> List[Tuple[str, str, Any]]:
    """(case name, model, port spec or None for the correct port), ResNet-18's first."""
    from porting import paddle_broken

    out: List[Tuple[str, str, Any]] = []
    for model in ("resnet18", "encoder"):
        out.append((f"{model}:correct", model, None))
        out += [(f"{model}:{name}", model, spec)
                for name, spec in paddle_broken.PORTS.items() if spec.model == model]
    return out


def build(model: str, spec: Any) -> Tuple[Any, Any, Any, Any]:
    """The torch reference (seed 0), the Paddle port, the input batch and the labels."""
    import numpy as np
    import paddle
    import torch
    from porting import paddle_encoder, paddle_resnet, torch_encoder, torch_resnet

    torch.manual_seed(0)
    paddle.seed(0)
    rng = np.random.default_rng(1)
    if model == "resnet18":
        ref, port = torch_resnet.resnet18(), (spec.build if spec else paddle_resnet.resnet18)()
        x = rng.standard_normal((BATCH, 3, 32, 32)).astype("float32")
        labels = rng.integers(0, 10, BATCH)
    else:
        ref = torch_encoder.EncoderClassifier()
        port = (spec.build if spec else paddle_encoder.EncoderClassifier)()
        x = rng.integers(0, 100, (BATCH, 16)).astype("int64")
        labels = rng.integers(0, 3, BATCH)
    return ref, port, x, labels


def expected(spec: Any) -> List[str]:
    """The layer names a right answer may give (paddle_broken's ``layer`` and ``named``)."""
    if spec is None:
        return []
    return [n for n in (spec.layer, spec.named) if n]


# ----------------------------------------------------------------------------- PaDiff
HERE_MARK = re.compile(r"\(([^()]*)\)\s+<---\s+\*\*\* HERE \*\*\*")
PADDLE_PATH = re.compile(r"paddle path:\s*\n\s*(\S+)")


def padiff_named(text: str, logs: str) -> str:
    """The Paddle layer PaDiff points at: the marked node of its Paddle tree (printed, or
    saved to diff_log/paddle_struct.log for a large model), else the parameters its grad/weight
    diff logs list (the first and the last, in the model's order); root class name stripped."""
    printed = text.split("Paddle Model", 1)[1] if "Paddle Model" in text else ""
    for source in (printed.split("Torch Model", 1)[0],
                   _read(os.path.join(logs, "paddle_struct.log"))):
        marked = [line for line in source.splitlines()
                  if "*** HERE ***" in line and not line.startswith("[AutoDiff]")]
        if marked:
            found = HERE_MARK.search(marked[0])
            if found:
                return found.group(1).split(".", 1)[-1]
            return marked[0].split("<---")[0].strip(" |+-")  # an API node has no path
    for name in ("grad_diff.log", "weight_diff.log"):
        params = [p.split(".", 1)[-1] for p in PADDLE_PATH.findall(_read(os.path.join(logs, name)))]
        if params:
            kind = name.split("_")[0]
            if len(params) == 1:
                return f"{params[0]} ({kind})"
            return f"{params[0]} ... {params[-1]} ({len(params)} {kind}s)"
    return ""


def _read(path: str) -> str:
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return ""


def padiff_check(ref: Any, port: Any, x: Any, labels: Any, options: Dict[str, Any],
                 logs: str) -> Dict[str, Any]:
    import paddle
    import padiff
    import torch

    paddle_y, torch_y = paddle.to_tensor(labels), torch.from_numpy(labels)
    losses = (lambda out: paddle.nn.functional.cross_entropy(out, paddle_y),
              lambda out: torch.nn.functional.cross_entropy(out, torch_y))
    inputs = ({"x": paddle.to_tensor(x)}, {"x": torch.from_numpy(x)})
    text = io.StringIO()
    start = time.perf_counter()
    try:
        with redirect_stdout(text), redirect_stderr(text):
            same = padiff.auto_diff(port, ref, inputs, auto_weights=True, options=dict(options),
                                    loss_fn=losses)
    except Exception as error:  # PaDiff raises on what it cannot run; that is its answer
        return {"status": f"error: {type(error).__name__}: {str(error).splitlines()[0][:120]}",
                "seconds": time.perf_counter() - start}
    seconds = time.perf_counter() - start
    found = not same
    return {"status": "ran", "found": found, "seconds": seconds,
            "named": padiff_named(text.getvalue(), logs) if found else ""}


def padiff_worker(names: Optional[List[str]], options: str) -> None:
    os.environ.setdefault("PADIFF_PATH_LOG", "ON")  # the tree then shows each layer's path
    try:
        import padiff
    except ImportError as error:  # padiff 0.2.0 imports yaml without declaring it
        missing = isinstance(error, ModuleNotFoundError) and error.name == "padiff"
        status = "not installed" if missing else f"import failed: {error}"
        for name, _, _ in cases():
            if names is None or name in names:
                _emit(name, {"status": status})
        return
    with tempfile.TemporaryDirectory(prefix="padiff-") as logs_home:
        # padiff writes its logs to diff_log/ under sys.path[0], and makes that folder once
        # per process: one folder for every case, emptied before each
        sys.path.insert(0, logs_home)
        logs = os.path.join(logs_home, "diff_log")
        for name, model, spec in cases():
            if names is not None and name not in names:
                continue
            shutil.rmtree(logs, ignore_errors=True)
            os.makedirs(logs)
            ref, port, x, labels = build(model, spec)
            row = padiff_check(ref, port, x, labels, PADIFF_OPTIONS[options], logs)
            row["version"] = padiff.__version__
            _emit(name, row)


# ----------------------------------------------------------------------------- gradmgr
def gradmgr_check(ref: Any, port: Any, x: Any, labels: Any) -> Dict[str, Any]:
    """gradmgr's column: ``compare_step`` on the same pair, the torch model the reference.

    HOOK: this is the call to keep once the Paddle adapter (gradmgr/backends/paddle/parity.py)
    lands; until then ``transfer_weights`` / ``compare_step`` refuse a Paddle model with
    ``UnsupportedBackendError`` (wrapped as ``ModelTypeError``) and the column says why."""
    import paddle
    import torch

    from gradmgr import UnsupportedBackendError
    from gradmgr.parity import MappingError, ModelTypeError, compare_step, transfer_weights

    def loss_a(out: Any, y: Any) -> Any:
        return torch.nn.functional.cross_entropy(out, y.long())

    def loss_b(out: Any, y: Any) -> Any:
        return paddle.nn.functional.cross_entropy(out, y.astype("int64"))

    start = time.perf_counter()
    try:
        try:
            transfer_weights(ref, port)
        except MappingError as refused:  # a layer configured otherwise: named before any step
            return {"status": "ran", "found": True, "seconds": time.perf_counter() - start,
                    "named": "; ".join(f.layer_dst for f in refused.report.findings)
                    or str(refused).splitlines()[1]}
        report = compare_step(ref, port, (x, labels), loss_a=loss_a, loss_b=loss_b)
    except (UnsupportedBackendError, ModelTypeError) as error:
        return {"status": f"not run: {str(error).splitlines()[0][:160]}"}
    seconds = time.perf_counter() - start
    return {"status": "ran", "found": not report.ok, "seconds": seconds,
            "named": gradmgr_named(report)}


def gradmgr_named(report: Any) -> str:
    """The layer the report blames: the first forward divergence, else the suspects of a
    backward-only one, else the first gradient, else a configuration finding."""
    if report.first_forward is not None:
        note = report.first_forward.note or ""
        through = note.split(", with no counterpart")[0] if "came through" in note else ""
        return report.first_forward.name + (f" ({through})" if through else "")
    if report.suspects:
        return "; ".join(report.suspects)
    if report.first_grad is not None:
        return report.first_grad.name
    return "; ".join(str(f) for f in report.findings)


def gradmgr_worker(names: Optional[List[str]]) -> None:
    for name, model, spec in cases():
        if names is None or name in names:
            _emit(name, gradmgr_check(*build(model, spec)))


# ----------------------------------------------------------------------------- the table
def _emit(name: str, row: Dict[str, Any]) -> None:
    print("CASE " + json.dumps({"case": name, **row}), flush=True)


def run_tool(args: List[str]) -> Dict[str, Dict[str, Any]]:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [ROOT] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]))
    done = subprocess.run([sys.executable, os.path.abspath(__file__)] + args, env=env,
                          capture_output=True, text=True)
    rows = {}
    for line in done.stdout.splitlines():
        if line.startswith("CASE "):
            row = json.loads(line[5:])
            rows[row.pop("case")] = row
    if done.returncode:
        rows["_failed"] = {"status": f"exit {done.returncode}: {done.stderr[-2000:]}"}
    return rows


def verdict(row: Dict[str, Any], spec: Any) -> str:
    if row.get("status") != "ran":
        return row.get("status", "?")
    if spec is None:
        return "false alarm" if row["found"] else "OK (right)"
    if not row["found"]:
        return "**false OK**"
    named = row["named"]
    right = any(named == n or named.endswith("/ " + n) or n in named.split("; ")
                or named.startswith(n + ".") and " " not in named for n in expected(spec))
    return f"found, {'right layer' if right else 'other layer'}: {named or '?'}"


def table(columns: Dict[str, Dict[str, Dict[str, Any]]]) -> str:
    head = "| case | kind | " + " | ".join(f"{c} | s" for c in columns) + " |"
    lines = [head, "|" + " --- |" * (2 + 2 * len(columns))]
    for name, _, spec in cases():
        kind = spec.kind if spec is not None else "correct"
        cells = []
        for rows in columns.values():
            row = rows.get(name, {"status": "missing"})
            cells += [verdict(row, spec), f"{row['seconds']:.2f}" if "seconds" in row else ""]
        lines.append(f"| {name} | {kind} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tool", choices=("padiff", "gradmgr"))
    parser.add_argument("--padiff-options", choices=sorted(PADIFF_OPTIONS), default="default")
    parser.add_argument("--cases", help="comma-separated case names (resnet18:correct, ...)")
    parser.add_argument("--json", help="write every column's rows here")
    args = parser.parse_args()
    names = args.cases.split(",") if args.cases else None
    if args.tool == "padiff":
        return padiff_worker(names, args.padiff_options)
    if args.tool == "gradmgr":
        return gradmgr_worker(names)
    only = ["--cases", args.cases] if args.cases else []
    columns = {f"PaDiff ({o})": run_tool(["--tool", "padiff", "--padiff-options", o] + only)
               for o in PADIFF_OPTIONS}
    columns["gradmgr"] = run_tool(["--tool", "gradmgr"] + only)
    print(machine())
    print(table(columns))
    for column, rows in columns.items():
        if "_failed" in rows:
            print(f"{column}: {rows['_failed']['status']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"machine": machine(), "columns": columns}, f, indent=1)


def machine() -> str:
    import platform

    import numpy
    import paddle
    import torch

    try:
        from importlib.metadata import version

        padiff_version = version("padiff")
    except Exception:  # noqa: BLE001 - not installed
        padiff_version = "not installed"
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    return (f"machine: {platform.processor() or platform.machine()}, "
            f"{len(os.sched_getaffinity(0))} cores usable, load average {load}; Python "
            f"{platform.python_version()}, torch {torch.__version__}, paddle "
            f"{paddle.__version__}, numpy {numpy.__version__}, padiff {padiff_version}")


if __name__ == "__main__":
    main()
