"""The ``gradmgr`` logger: silent unless asked. It reports the decisions the library makes
(which path a data-parallel step takes, the bucket plan, the plan check's own group), each
once when it is made, never per step.

Ask with the standard logging configuration (``logging.getLogger("gradmgr").setLevel(
logging.INFO)`` and a handler), or with ``GRADMGR_LOG=info`` (or ``debug``) in the
environment, which gives the ``gradmgr`` logger a handler on stderr at that level.
"""

from __future__ import annotations

import logging
import os
import warnings

logger = logging.getLogger("gradmgr")
logger.addHandler(logging.NullHandler())  # silent by default, as a library should be

_FORMAT = "gradmgr %(levelname)s [%(name)s] %(message)s"


def configure_from_env() -> None:
    """``GRADMGR_LOG=info`` (a level name, any case): log to stderr at that level."""
    wanted = os.environ.get("GRADMGR_LOG", "").strip().upper()
    if not wanted:
        return
    level = logging.getLevelName(wanted)
    if not isinstance(level, int):  # a typo must not stop the import: say so, log nothing
        warnings.warn(f"GRADMGR_LOG={os.environ['GRADMGR_LOG']!r} is not a logging level "
                      "(debug, info, warning): gradmgr logs nothing", stacklevel=2)
        return
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter(_FORMAT))
    logger.addHandler(handler)
    logger.setLevel(level)
