"""Where every process of a run meets: the decisions all must take at the same step."""

from __future__ import annotations

import jax
import numpy as np
from jax.experimental import multihost_utils


def any_process(flag: bool) -> bool:
    """Whether `flag` holds on any process (a collective in a multi-process run: every process calls
    it at the same step, so all decide alike)."""
    if jax.process_count() == 1:
        return flag
    return bool(np.max(multihost_utils.process_allgather(np.int32(flag))))
