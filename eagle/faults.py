"""Fault injection for tests: kill this process at an instant a test chooses, to show that a killed run resumes.

    EAGLE_FAULT=checkpoint-between-renames@7 eagle train ...     # SIGKILL between a checkpoint's renames, step 7
    EAGLE_FAULT=journal-shard@2 eagle prep ...                   # SIGKILL once prep's journal has 2 shards

Points: `checkpoint-between-renames` (train.loop.save_checkpoint), `journal-shard` (data_prep.journal: after the
index names a new shard; the number is the count of shards).
"""

from __future__ import annotations

import os
import signal

FAULT_ENV = "EAGLE_FAULT"  # POINT or POINT@N


def fault(point: str, n: int) -> None:
    """SIGKILL this process at `point` when the environment variable EAGLE_FAULT names it (`POINT`, or `POINT@N` for
    the given step or count only)."""
    name, _, at = os.environ.get(FAULT_ENV, "").partition("@")
    if name == point and (not at or int(at) == n):
        os.kill(os.getpid(), signal.SIGKILL)
