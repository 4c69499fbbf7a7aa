"""Hypothesis settings for the differential suite.

Every test is derandomized (the same examples on every run, so CI is reproducible) with no
example database and no deadline. ``differential_settings(n)`` gives a test ``n`` examples:

* ``GRADMGR_DIFF_EXAMPLES=<n>``: every test runs ``n`` examples instead;
* ``GRADMGR_HYPOTHESIS_PROFILE=long``: the ``gradmgr-differential-long`` profile, 20x the
  examples (at least 500) of each test;
* ``GRADMGR_DIFF_SEED=<int>``: leave derandomization and use this seed, to explore examples
  other than the fixed ones (still reproducible with the same seed).
"""

from __future__ import annotations

import os
from typing import Callable

from hypothesis import HealthCheck, Phase, seed, settings

_COMMON = dict(
    derandomize=True,
    database=None,
    deadline=None,
    print_blob=False,
    phases=(Phase.explicit, Phase.generate, Phase.target, Phase.shrink),
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                           HealthCheck.filter_too_much],
)
settings.register_profile("gradmgr-differential", **_COMMON)
settings.register_profile("gradmgr-differential-long", **_COMMON)

LONG = os.environ.get("GRADMGR_HYPOTHESIS_PROFILE", "") in ("long", "gradmgr-differential-long")
PROFILE = "gradmgr-differential-long" if LONG else "gradmgr-differential"
EXAMPLES = os.environ.get("GRADMGR_DIFF_EXAMPLES")
SEED = os.environ.get("GRADMGR_DIFF_SEED")


def differential_settings(n: int) -> Callable:
    """Decorator: the suite's profile with ``n`` examples (see the module docstring)."""
    count = int(EXAMPLES) if EXAMPLES else (max(20 * n, 500) if LONG else n)
    chosen = settings(settings.get_profile(PROFILE), max_examples=count,
                      derandomize=SEED is None)

    def decorate(test):
        test = chosen(test)
        return seed(int(SEED))(test) if SEED is not None else test

    return decorate
