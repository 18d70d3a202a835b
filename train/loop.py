"""Train an EAGLE-1/2 or EAGLE-3 head on rows prepared by `eagle prep`; resumable, budgeted by steps, minutes or
epochs; in one process or in several (`train.parallel`).

    eagle train --config configs/smollm2-135m-eagle1.yaml budget.minutes=10
    eagle train --config configs/smollm2-135m-eagle3.yaml data.online=true

`train` runs the steps: 1 check the config, 2 resume the last complete checkpoint's state, 3 the rows and their
target features (train.data, train.features), 4 the head, 5 the optimizer, 6 the CPU backend for the head's
products, 7 `fit`: steps (train.losses) on batches from the loader, checkpoints (train.checkpoints) and validation
(train.validate), whose best head (the simulated tau along every held-out row) is exported to `out`. Rerunning the
same command resumes from `run_dir/checkpoint`; a kill at any instant, SIGKILL included, resumes from the last
complete checkpoint.
"""

from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import torch
from tqdm import tqdm

import cpu_backend
from data_prep import draft_vocabulary
from eagle import EagleHead, HeadConfig, TargetModel, load_target
from eagle.checkpoint import save_head
from eagle.device import resolve_device
from eagle.head import load_head, make_head
from eagle.memory import TargetSize
from eagle.target import target_config
from train.checkpoints import TrainState, check_finite, last_good, resume_state, save_checkpoint
from train.config import TrainConfig, TrainError, check_config
from train.data import Batch, BatchLoader, TrainData, default_workers, load_data, make_batches, row_groups
from train.features import batch_features
from train.losses import head_loss
from train.parallel import Ranks, average_gradients
from train.plan import check_training_fits
from train.precision import Optim, Precision
from train.runlog import RunLog
from train.validate import validate


def train(cfg: TrainConfig, target: TargetModel | None = None) -> TrainState:
    """Train (or resume) the head `cfg` describes, in this process or in each of several (`train.parallel`);
    returns the final trainer state."""
    from accelerate import Accelerator
    from accelerate.utils import InitProcessGroupKwargs

    check_config(cfg)                                    # 1. one-line errors before any time is spent
    # a target handed in decides the device unless the config names one
    device = target.device if target is not None and cfg.device == "auto" else resolve_device(cfg.device)
    if device.type == "cuda" and device.index is not None:
        torch.cuda.set_device(device)  # accelerate takes the current device
    # a process may wait at a barrier for another that loads a 70B target or validates: a process group that waits
    # longer than NCCL's default 10 minutes
    wait = InitProcessGroupKwargs(timeout=timedelta(hours=float(os.environ.get("EAGLE_DIST_TIMEOUT_HOURS", 12))))
    owned = not (torch.distributed.is_available() and torch.distributed.is_initialized())
    accelerator = Accelerator(cpu=device.type == "cpu", kwargs_handlers=[wait])
    state = _train(cfg, target, accelerator)
    # the process group this run made (under torchrun) closed here: left to the interpreter's exit, gloo's threads
    # have aborted a process that had finished its work ("terminate called without an active exception")
    if owned:
        accelerator.end_training()
    return state


def _train(cfg: TrainConfig, target: TargetModel | None, accelerator) -> TrainState:
    """`train`'s steps after the launch: 2-7 below, in every process."""
    ranks = Ranks.of(accelerator)
    precision = Precision.of(cfg, accelerator.device, target)
    check_launch(cfg, accelerator, precision)
    run = Path(cfg.run_dir)
    state = resume_state(cfg, run, ranks)                # 2. the last complete checkpoint's state, if any
    if state and state.done:
        say(ranks, f"training in {run} already finished at step {state.step}; best head in {cfg.out}")
        return state
    if not cfg.model.device_map:  # refuse, before the target loads, a run the device cannot hold (train.plan)
        size = TargetSize.of_module(target.model) if target is not None else \
            TargetSize.of(target_config(cfg.model.target)[0])
        check_training_fits(cfg, size, accelerator.device, precision, ranks)
    # on cached features a target's decoder layers are not loaded (`load_data` loads them if features are missing)
    target = target or load_target(cfg.model.target, device=accelerator.device, dtype=precision.target,
                                   device_map=cfg.model.device_map or None,
                                   layers=cfg.data.online or bool(cfg.model.device_map))
    data = load_data(cfg, target, ranks)                 # 3. rows, target features (a missing store computed by
                                                         #    every process, each its share), held-out rows, prompts
    head = (load_head(run / "checkpoint" / "head", device=accelerator.device, dtype=precision.head).attach(target)
            if state else new_head(cfg, target, data, accelerator.device, precision.head))  # 4. the head, alike
    head.train()                                                                           # everywhere
    optim = Optim.of(cfg, head, precision)
    if state:                                            # 5. the optimizer (and fp16's loss scale), resumed
        optim.load(run / "checkpoint", state)
    if cfg.cpu.fast_path and cpu_backend.applies(head) and precision.compute is None and \
            precision.target == torch.float32:
        cpu_backend.enable(head)                         # 6. the head's products through the CPU backend
        slower = cpu_backend.plan_training(head, min(cfg.optim.batch_tokens, 1024))  # ... where it beats F.linear's
        if slower:
            say(ranks, f"training products through F.linear for {', '.join(slower)} (measured faster than the kernel)")
    state = fit(cfg, head, optim, target, data, run, state, ranks)  # 7. steps, checkpoints, validation
    say(ranks, f"done: {state.step} steps, {state.tokens} tokens in {state.train_s / 60:.1f} min of training "
               f"({state.wait_s / max(state.train_s, 1e-9):.0%} of it waiting for data); best simulated validation "
               f"tau {state.best_tau:.3f} (k = {cfg.eval.num_speculative_tokens}); head in {cfg.out}")
    return state


def check_launch(cfg: TrainConfig, accelerator, precision: Precision) -> None:
    """One-line TrainErrors for launches this loop does not serve: it replicates the head and averages gradients
    itself (train.parallel), so no DeepSpeed, FSDP or XLA plugin; the precision is the config's, not accelerate's;
    a target spread over devices (model.device_map) is for one process."""
    from accelerate.utils import DistributedType

    kind = accelerator.distributed_type
    if kind not in (DistributedType.NO, DistributedType.MULTI_GPU, DistributedType.MULTI_CPU):
        raise TrainError(f"accelerate launched with distributed_type {kind.value}: eagle train runs plain data "
                         "parallel processes (MULTI_GPU or MULTI_CPU); run `accelerate config` without DeepSpeed/FSDP")
    asked = {"no": "none"}.get(accelerator.mixed_precision, accelerator.mixed_precision)
    if asked != "none" and asked != precision.mixed_precision:
        raise TrainError(f"accelerate's mixed_precision is {accelerator.mixed_precision} but the config's "
                         f"mixed_precision is {precision.mixed_precision}: set mixed_precision in the training "
                         "config (none, bf16 or fp16) and launch with --mixed_precision no")
    if cfg.model.device_map and accelerator.num_processes > 1:
        raise TrainError(f"model.device_map {cfg.model.device_map!r} spreads one target over the devices; with "
                         f"{accelerator.num_processes} processes each would load it so: use one process, or none")


def say(ranks: Ranks, text: str) -> None:
    """Print on the main process only."""
    if ranks.main:
        print(text, flush=True)


def new_head(cfg: TrainConfig, target: TargetModel, data: TrainData, device, dtype) -> EagleHead:
    """A fresh head shaped after the target, over the draft vocabulary `data_prep.draft_vocabulary` picks from the
    training rows, initialised as `model.init` says."""
    torch.manual_seed(cfg.seed)
    vocab = draft_vocabulary(data.rows, target.vocab_size, cfg.model.draft_vocab, target.tokenizer,
                             cfg.model.vocab_counts, cfg.model.vocab_count_rows)
    shape = {"num_layers": cfg.model.num_layers, "fc_bias": cfg.model.fc_bias}
    if data.layers is not None:
        shape.update(head_type="eagle3", feature_layer_ids=data.layers, fc_bias=False, fc_norm=cfg.model.fc_norm,
                     norm_output=cfg.model.norm_output)
    hcfg = HeadConfig.for_target(target, draft_vocab_size=0 if vocab is None else vocab.shape[0], **shape)
    head = make_head(hcfg).to(device=device, dtype=dtype).attach(target)
    if vocab is not None:
        head.set_draft_vocab(vocab.to(device))
    if data.layers is not None:
        head.init_from_target_lm_head(target)
    if cfg.model.init == "identity":
        head.init_identity_fc()
    elif cfg.model.init == "target_last_layer":
        head.init_from_target_layer(target)
    return head


@dataclass
class Schedule:
    """The budget (training seconds and / or steps) and the learning rate over it: linear warm-up, then a cosine
    to zero at the end of the budget."""

    lr: float
    warmup_steps: int
    limit_s: float  # 0: no time limit
    max_steps: int  # 0: no step limit

    def progress(self, state: TrainState) -> float:
        parts = [state.train_s / self.limit_s if self.limit_s else 0.0,
                 state.step / self.max_steps if self.max_steps else 0.0]
        return min(1.0, max(parts))

    def lr_at(self, state: TrainState) -> float:
        warm = min(1.0, (state.step + 1) / max(1, self.warmup_steps))
        return self.lr * warm * 0.5 * (1 + math.cos(math.pi * self.progress(state)))


def fit(cfg: TrainConfig, head, optim: Optim, target, data: TrainData, run: Path, state: TrainState | None,
        ranks: Ranks = Ranks()) -> TrainState:
    """The training steps from `state` (None: the start) to the end of the budget, with checkpoints every
    `save_every_minutes` and validation every `eval.every_minutes` and at the end; returns the final state. A step
    takes `optim.accumulate` micro-batches on each process (`train.parallel`), from the loader (`train.data`)."""
    state = state or TrainState(num_processes=ranks.count, accumulate=cfg.optim.accumulate,
                                batch_tokens=cfg.optim.batch_tokens)
    state.feature_s += data.feature_s  # every pass this run made, resumed ones too
    lengths = [r[0].shape[0] for r in data.rows]
    A = cfg.optim.accumulate
    per_step = A * ranks.count  # micro-batches an optimizer step takes, over every process
    groups = row_groups(cfg, data)
    steps_per_epoch = len(make_batches(lengths, cfg.optim.batch_tokens, torch.Generator(), groups)) // per_step
    if steps_per_epoch < 1:
        raise TrainError(f"{len(data.rows)} training rows make fewer batches of optim.batch_tokens "
                         f"{cfg.optim.batch_tokens} than a step takes ({A} x {ranks.count} processes): lower them, "
                         "or prepare more rows")
    schedule = Schedule(cfg.optim.lr, cfg.optim.warmup_steps, cfg.budget.minutes * 60, cfg.budget.max_steps or (
        int(cfg.budget.epochs * steps_per_epoch) if cfg.budget.epochs else 0))
    device = next(head.parameters()).device
    loader = BatchLoader(data.rows, data.feats, cfg, device)
    log = RunLog(run, cfg.tensorboard, resume_step=state.step, resume_bytes=state.log_bytes, writer=ranks.main)
    say(ranks, f"{len(data.rows)} train rows ({sum(lengths)} tokens), {len(data.val_rows)} val rows, "
               f"{steps_per_epoch} steps/epoch of {A} x {ranks.count} batches "
               f"({ranks.count} process{'es' if ranks.count > 1 else ''}, {default_workers(cfg, device)} data "
               f"workers each); target features in {data.feature_s:.1f}s"
               + (f"; resuming at step {state.step}" if state.step else ""))
    bar = tqdm(total=int(schedule.limit_s) if schedule.limit_s else schedule.max_steps,
               initial=int(state.train_s) if schedule.limit_s else state.step,
               unit="s" if schedule.limit_s else "step", desc="train", dynamic_ncols=True, disable=not ranks.main,
               bar_format="{l_bar}{bar}| {n_fmt}/{total_fmt}{unit} [{elapsed}<{remaining}{postfix}]")
    last_save = last_val = state.train_s
    tok_window, wait_window, t_window = 0, 0.0, time.perf_counter()
    try:
        while schedule.progress(state) < 1.0:
            batches = make_batches(lengths, cfg.optim.batch_tokens,
                                   torch.Generator().manual_seed(cfg.seed * 7919 + state.epoch), groups)
            # this process's micro-batches of the epoch's steps left: step b, micro-batch a
            stream = loader.epoch([batches[b * per_step + a * ranks.count + ranks.index]
                                   for b in range(state.batch_in_epoch, steps_per_epoch) for a in range(A)])
            for b in range(state.batch_in_epoch, steps_per_epoch):
                t0 = time.perf_counter()
                micro = [next(stream) for _ in range(A)]
                waited = time.perf_counter() - t0
                m = train_step(cfg, head, optim, target, data, micro, schedule.lr_at(state), state, run, ranks,
                               waited)
                state.step += 1
                state.batch_in_epoch = b + 1
                state.train_s += m.pop("seconds")
                state.wait_s += m["data_wait_s"]
                state.tokens += m["tokens_all"]
                tok_window += m.pop("tokens_all")
                wait_window += m.pop("data_wait_s")
                bar.update(int(state.train_s) - bar.n if schedule.limit_s else 1)  # whole seconds
                if state.step % cfg.log_every == 0:
                    span = time.perf_counter() - t_window
                    tps, data_wait = tok_window / span, min(1.0, wait_window / span)
                    tok_window, wait_window, t_window = 0, 0.0, time.perf_counter()
                    bar.set_postfix(loss=f"{m['loss']:.3f}", acc=f"{m['acc']:.3f}", tok_s=f"{tps:.0f}")
                    log.write({"step": state.step, "lr": schedule.lr_at(state), "tok_s": round(tps),
                               "data_wait": round(data_wait, 4), **m}, "train")
                if schedule.progress(state) >= 1.0:
                    break
                if cfg.eval.every_minutes > 0 and state.train_s - last_val >= cfg.eval.every_minutes * 60:
                    checkpoint_and_validate(cfg, head, optim, target, data, run, state, log, ranks, final=False)
                    last_val = last_save = state.train_s
                elif state.train_s - last_save >= cfg.save_every_minutes * 60:
                    state.log_bytes = log.mark()
                    if ranks.main:
                        save_checkpoint(run, head, optim, state)
                    ranks.barrier()
                    last_save = state.train_s
            else:
                state.epoch += 1
                state.batch_in_epoch = 0
        bar.close()
        checkpoint_and_validate(cfg, head, optim, target, data, run, state, log, ranks, final=True)
    finally:
        bar.close()
        log.close()
    return state


def train_step(cfg: TrainConfig, head, optim: Optim, target, data: TrainData, micro: list[Batch], lr: float,
               state: TrainState, run: Path, ranks: Ranks = Ranks(), waited: float = 0.0) -> dict:
    """One optimizer step on this process's micro-batches `micro`: their gradients averaged, and with several
    processes averaged over them too (`train.parallel.average_gradients`, which also sums the metrics and seconds,
    so every process sees the same). Returns the step's metrics (loss and accuracy: the means over the
    micro-batches), `tokens_all` (every process's), `seconds` (their mean, with the `waited` for the batches) and
    `data_wait_s` (the mean wait). A loss or gradient norm that is not finite on any process stops training on all
    of them with a TrainError naming the last good checkpoint, before the weights change; with float16 products a
    gradient that overflowed skips the step and lowers the loss scale instead (`torch.amp.GradScaler`)."""
    t0 = time.perf_counter()
    p0 = next(head.parameters())
    dev, dtype, A = p0.device, p0.dtype, len(micro)
    compute, scaler = optim.precision.compute, optim.scaler
    for g in optim.opt.param_groups:
        g["lr"] = lr
    optim.opt.zero_grad(set_to_none=True)
    sums, extra = [0.0, 0.0, 0.0, 0.0], {}  # loss, acc, tokens, non-finite losses; the last batch's other metrics
    for a, batch in enumerate(micro):
        batch = batch.to(dev)
        # online: the target computes the features now, on its device
        feats = batch.feats if batch.feats is not None else batch_features(target, batch.ids, data.layers)
        # each micro-batch's draws (noise, dropout, chain starts) depend on the step and its place in the step
        # alone, on the training device: exact resume, and the same draws whatever the split between processes
        gen = torch.Generator(device=dev).manual_seed(cfg.seed * 1_000_003 + state.step * A * ranks.count
                                                      + a * ranks.count + ranks.index)
        with torch.autocast(dev.type, dtype=compute or torch.bfloat16, enabled=compute is not None):
            loss, m = head_loss(head, batch.ids, batch.mask, feats.to(dev, dtype), cfg, gen)
        if not math.isfinite(m["loss"]):
            sums[3] += 1
            continue
        scaler.scale(loss / A if A > 1 else loss).backward()
        sums[0], sums[1], sums[2] = sums[0] + m["loss"], sums[1] + m["acc"], sums[2] + batch.ids.numel()
        extra = {k: v for k, v in m.items() if k not in ("loss", "acc")}
    seconds = time.perf_counter() - t0 + waited
    total = average_gradients(optim.params, [*sums, seconds, waited], ranks)
    where = f"at step {state.step} (batch {state.batch_in_epoch} of epoch {state.epoch})"
    if total[3]:  # (the loss scale of fp16 cannot help: it scales gradients, and this is the forward pass)
        hint = "; float16 products overflow there: mixed_precision=bf16 keeps float32's range" \
            if compute == torch.float16 else ""
        raise TrainError(f"loss is nan {where}: training stopped; {last_good(run, state.step)}{hint}")
    scaler.unscale_(optim.opt)
    if cfg.optim.grad_clip:
        norm = torch.nn.utils.clip_grad_norm_(optim.params, cfg.optim.grad_clip)
        if not math.isfinite(float(norm)) and not scaler.is_enabled():  # before the step: the weights stay finite
            raise TrainError(f"gradient norm is {float(norm)} {where}: training stopped; {last_good(run, state.step)}")
    scaler.step(optim.opt)  # (fp16: skipped when a gradient overflowed; the next steps run at a lower scale)
    scaler.update()
    n = A * ranks.count
    return {"loss": total[0] / n, "acc": total[1] / n, **extra, "tokens_all": int(total[2]),
            "seconds": total[4] / ranks.count, "data_wait_s": total[5] / ranks.count}


def checkpoint_and_validate(cfg: TrainConfig, head, optim: Optim, target, data: TrainData, run: Path,
                            state: TrainState, log: RunLog, ranks: Ranks, final: bool) -> None:
    """Validate (every process its share); the main process exports the head to `out` when its simulated tau is the
    best so far, then writes the checkpoint."""
    check_finite(head, run, state)
    v = validate(head, target, data.val_rows, data.val_feats, data.prompts, cfg, ranks, data.decode_target)
    score = v["val_sim_tau"]  # every held-out row, so far less noisy than decoding a few prompts
    best = score > state.best_tau
    if best:
        state.best_tau = score
    state.done = final
    rec = {"step": state.step, "train_min": round(state.train_s / 60, 2), **v, "best": state.best_tau}
    log.write(rec, "val")
    state.log_bytes = log.mark()
    if ranks.main:
        if best:
            save_head(head, Path(cfg.out), extra={"step": state.step, **v}, dtype=optim.precision.save)
        save_checkpoint(run, head, optim, state)
        tqdm.write("validation: " + ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}"
                                              for k, v in rec.items()))
    ranks.barrier()
