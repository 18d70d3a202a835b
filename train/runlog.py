"""Training records: one JSON object a line in `run_dir/log.jsonl`, and the numbers as TensorBoard scalars in
`run_dir/tensorboard` (with the tensorboard package: `pip install -e '.[logs]'`, which `make` installs).

    tensorboard --logdir runs/demo/train/tensorboard
"""

from __future__ import annotations

import json
import os
from pathlib import Path


class RunLog:
    def __init__(self, run: Path, tensorboard: bool, resume_step: int = 0, resume_bytes: int | None = None,
                 writer: bool = True):
        """`resume_step`: a resumed run's step; TensorBoard drops what an earlier run logged after it.
        `resume_bytes`: the log's length at that checkpoint (`mark`); lines a killed run wrote after it are cut, so
        the resumed run writes each step once. `writer` False (every process but the main one): nothing is
        written."""
        self.file = self.tb = None
        if not writer:
            return
        self.file = open(run / "log.jsonl", "a")
        if resume_bytes is not None and self.file.tell() > resume_bytes:
            self.file.truncate(resume_bytes)
        self.tb = None
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError:
                print("note: tensorboard=true, but the tensorboard package is not installed (pip install tensorboard): "
                      "logging to log.jsonl only")
            else:
                self.tb = SummaryWriter(str(run / "tensorboard"), purge_step=resume_step or None)

    def write(self, rec: dict, group: str) -> None:
        """`rec` holds `step`; its numbers (and lists of numbers, one scalar per index) go to TensorBoard under
        `group/` (train or val). Validation records are flushed at once; training steps buffer (the hot loop)."""
        if self.file is None:
            return
        self.file.write(json.dumps(rec) + "\n")
        if self.tb is not None:
            for k, v in rec.items():
                values = v if isinstance(v, list) else [v]
                for i, x in enumerate(values):
                    if k != "step" and isinstance(x, (int, float)) and not isinstance(x, bool):
                        self.tb.add_scalar(f"{group}/{k}" + (f"_{i + 1}" if isinstance(v, list) else ""), x,
                                           rec["step"])
        if group == "val":
            self.file.flush()
            if self.tb is not None:
                self.tb.flush()

    def mark(self) -> int:
        """Flush the lines written so far (to the disk too) and return the log's length, for a checkpoint to
        record."""
        if self.file is None:
            return 0
        self.file.flush()
        os.fsync(self.file.fileno())
        return self.file.tell()

    def close(self) -> None:
        if self.file is not None:
            self.file.close()
        if self.tb is not None:
            self.tb.close()
