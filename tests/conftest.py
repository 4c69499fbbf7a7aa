"""Fixtures shared by the suites. ``fw`` parametrizes a test over every backend, so a failure
names its backend (``test_x[torch]``, ``test_x[megengine]``)."""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))

from frameworks import make_framework  # noqa: E402

BACKENDS = ["torch", "megengine"]


def _require(name: str) -> None:
    pytest.importorskip(name, reason=f"{name} is not installed in this environment")


@pytest.fixture(params=BACKENDS)
def fw(request):
    """The op table of one framework, on the CPU."""
    _require(request.param)
    return make_framework(request.param)


@pytest.fixture
def torch_fw():
    _require("torch")
    return make_framework("torch")


@pytest.fixture
def mge_fw():
    _require("megengine")
    return make_framework("megengine")


def cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()
