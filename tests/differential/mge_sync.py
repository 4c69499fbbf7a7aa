"""The fixture every MegEngine differential test module uses (imported there: autouse)."""

from __future__ import annotations

import pytest


@pytest.fixture(autouse=True)
def mge_synchronous():
    """Run MegEngine synchronously: a kernel error then raises where it happens (and is
    compared like any other outcome) instead of aborting the process or surfacing later."""
    import megengine

    level = megengine.config.async_level
    megengine.config.async_level = 0
    yield
    megengine.config.async_level = level
