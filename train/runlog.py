"""Training records: one JSON object a line in `run_dir/log.jsonl`, and the numbers as TensorBoard scalars in
`run_dir/tensorboard` (with the tensorboard package: `pip install -e '.[logs]'`, which `make` installs).

    tensorboard --logdir runs/demo/train/tensorboard
"""

from __future__ import annotations

import json
from pathlib import Path


class RunLog:
    def __init__(self, run: Path, tensorboard: bool, resume_step: int = 0):
        """`resume_step`: a resumed run's step; TensorBoard drops what an earlier run logged after it."""
        self.file = open(run / "log.jsonl", "a")
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

    def close(self) -> None:
        self.file.close()
        if self.tb is not None:
            self.tb.close()
