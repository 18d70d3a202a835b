"""Checkpoints and resume: where a run is (`TrainState`), written whole with the head and the optimizer into
`run_dir/checkpoint` so that a run killed at any instant, SIGKILL included, resumes from its last complete one.

    state = resume_state(cfg, run, ranks)     # None for a new run
    save_checkpoint(run, head, optim, state)
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch

from eagle.checkpoint import fsync_path, recover_dir, replace_dir, save_head
from eagle.configio import save_config
from eagle.faults import fault
from train.config import TrainConfig, TrainError
from train.parallel import Ranks


@dataclass
class TrainState:
    """Where a run is: saved whole in every checkpoint (`state.json`) and resumed from it."""

    step: int = 0
    epoch: int = 0
    batch_in_epoch: int = 0  # optimizer steps of the epoch done
    train_s: float = 0.0  # seconds in training steps (the budget's clock)
    best_tau: float = -1.0  # the best validation's simulated tau
    tokens: int = 0  # padded tokens trained on, every process's
    done: bool = False
    num_processes: int = 1
    accumulate: int = 1  # (the batches and the place in an epoch depend on these two)
    batch_tokens: int = 0
    feature_s: float = 0.0  # seconds of feature passes, every run of this run_dir's
    wait_s: float = 0.0  # seconds waiting for batches from the data loader
    log_bytes: int | None = None  # log.jsonl's length at this checkpoint (a resumed run cuts what came after)
    loss_scale: dict | None = None  # fp16's GradScaler

    @classmethod
    def read(cls, path: Path) -> "TrainState":
        """A checkpoint's state.json; keys an older run wrote and this one does not know are dropped."""
        raw = json.loads(Path(path).read_text())
        known = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in raw.items() if k in known})

    def write(self, path: Path) -> None:
        Path(path).write_text(json.dumps(dataclasses.asdict(self)))


def save_checkpoint(run: Path, head, optim, state: TrainState) -> None:
    """run/checkpoint holds head + optimizer (`optim.save`) + trainer state. It is written whole into
    run/checkpoint.tmp (a partial one left by a kill is removed first: the name is ours) and flushed to the disk,
    then renamed in by `eagle.checkpoint.replace_dir`: the previous checkpoint is renamed to run/checkpoint.prev and
    removed only once the new one is in place, and `last_checkpoint` puts checkpoint.prev back when a kill came
    between the two renames. So a kill at any instant leaves a complete checkpoint.
    EAGLE_FAULT=checkpoint-between-renames[@STEP] kills the process between the renames (`eagle.faults`)."""
    check_finite(head, run, state)
    tmp = run / "checkpoint.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    save_head(head, tmp / "head")
    optim.save(tmp, state)
    state.write(tmp / "state.json")
    for f in (tmp / "optimizer.pt", tmp / "state.json", tmp):
        fsync_path(f)
    replace_dir(tmp, run / "checkpoint", between=lambda: fault("checkpoint-between-renames", state.step))


def check_finite(head, run: Path, state: TrainState) -> None:
    """Stop, in one line, before weights that are not finite replace a good checkpoint or head. Every process holds
    the same weights, so every process stops alike."""
    bad = [k for k, v in head.trainable_state_dict().items() if v.is_floating_point() and not v.isfinite().all()]
    if bad:
        raise TrainError(f"the weights are not finite after step {state.step} ({', '.join(bad[:3])}): training "
                         f"stopped; {last_good(run, state.step)}")


def last_checkpoint(run: Path) -> Path | None:
    """run/checkpoint, the last complete checkpoint (put back from checkpoint.prev when a kill came between
    `save_checkpoint`'s renames), or None; a partial checkpoint.tmp is never read."""
    return recover_dir(run / "checkpoint")


def last_good(run: Path, step: int) -> str:
    """Where the last checkpoint of a run stopped at `step` is, for its error message: a checkpoint of that very step
    holds the weights that gave the bad loss."""
    ckpt = run / "checkpoint"
    if not (ckpt / "state.json").exists():
        return "no checkpoint was written yet"
    saved = TrainState.read(ckpt / "state.json").step
    if saved < step:
        return f"the last good checkpoint, {ckpt} (step {saved}), is kept"
    return f"the last checkpoint, {ckpt} (step {saved}), is kept (the weights this step started from)"


def resume_state(cfg: TrainConfig, run: Path, ranks: Ranks = Ranks()) -> TrainState | None:
    """The run directory made (its resolved config.yaml written, with the number of processes) and the state of its
    last complete checkpoint, or None for a new run; a head write killed between its renames is undone first. The
    main process writes; the others wait, then read the same state."""
    if cfg.num_processes not in (0, ranks.count):
        raise TrainError(f"num_processes {cfg.num_processes} in the config, but {ranks.count} processes were launched")
    if cfg.num_threads:
        torch.set_num_threads(cfg.num_threads)
    if ranks.main:
        recover_dir(Path(cfg.out))
        run.mkdir(parents=True, exist_ok=True)
        last_checkpoint(run)
    ranks.barrier()
    ckpt = run / "checkpoint" / "state.json"
    state = TrainState.read(ckpt) if ckpt.exists() else None
    if state and not state.done and state.num_processes != ranks.count:
        raise TrainError(f"run_dir {str(run)!r} was trained by {state.num_processes} processes: resume it with "
                         f"{state.num_processes} (launched: {ranks.count}), or start a new run_dir")
    for key in ("accumulate", "batch_tokens"):  # the batches and the place in the epoch depend on them
        was, now = getattr(state, key, None), getattr(cfg.optim, key)
        if state and not state.done and was and was != now:
            raise TrainError(f"run_dir {str(run)!r} was trained with optim.{key} {was}: resume it with {was} "
                             f"(given: {now}), or start a new run_dir")
    cfg.num_processes = ranks.count
    if ranks.main and not (state and state.done):
        save_config(cfg, run / "config.yaml")
    return state
