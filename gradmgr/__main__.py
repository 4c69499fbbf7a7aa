"""The ``gradmgr`` command (also ``python -m gradmgr``): ``gradmgr env`` prints what a bug
report needs (:mod:`gradmgr.env`)."""

from __future__ import annotations

import argparse
from typing import List, Optional


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="gradmgr", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("env", help="versions against the tested ones, backends, extras, "
                                    "distributed backends and devices, for a bug report")
    parser.parse_args(argv)
    from .env import render, sections

    print(render(sections()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
