"""`eagle plan`: what a run will need, before anything runs: the features' bytes on the disk, regeneration's peak
host memory, and each training process's peak device memory with the largest `optim.batch_tokens` that fits, from
the target's config and tokenizer alone (no weights loaded) and the data's token counts.

    eagle plan --target smollm2-135m --data sharegpt --max-rows 2400 --max-new-tokens 128 --max-length 448
    eagle plan --target meta-llama/Llama-3.1-8B-Instruct --rows 68000 --tokens-per-row 1000 --gpus 8 \\
        --gpu-memory 80 --head-type eagle3 --draft-vocab 32000 --json

The arithmetic is `eagle.memory`'s; `eagle prep` and `eagle train` refuse with the same numbers a run whose features
do not fit on the disk or whose head does not fit on the device. A field left unset takes `eagle prep`'s or `eagle
train`'s default (PrepConfig, TrainConfig).
"""

from __future__ import annotations

import json
import resource
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from data_prep.prep import PrepConfig, planned_rows
from data_prep.regenerate import PREFILL_TOKENS
from eagle.device import resolve_dtype
from eagle.features import default_dtype
from eagle.configio import load_config
from eagle.memory import HeadSize, TargetSize, largest_batch_tokens, pass_needs, prep_needs, train_needs
from eagle.target import target_config
from train.config import TrainConfig
from train.parallel import Ranks
from train.precision import Precision


class PlanError(ValueError):
    pass


@dataclass
class PlanConfig:
    target: str = ""
    data: str = ""  # a conversation source as `eagle prep` reads it (rendered and counted), or:
    rows: int = 0  # instead of data: this many rows of ...
    tokens_per_row: int = 0  # ... this many tokens each (with regenerate: the prompt; the reply adds max_new_tokens)
    # prep's side (unset: eagle prep's defaults)
    max_rows: int | None = None
    skip_rows: int = 0
    max_length: int | None = None
    max_new_tokens: int | None = None
    max_turns: int | None = 1
    regenerate: bool = True  # one-turn regeneration keeping the features (prep's usual recipe for a head)
    regen_batch_size: int | None = None
    dtype: str = "auto"  # the target's: auto (bfloat16 on GPUs, float32 on a CPU), float32, bfloat16, float16
    feature_dtype: str = "auto"  # the stored features': auto (the target's), float32, bfloat16, float16
    # training's side: a preset (a TrainConfig YAML), and these of its keys (unset: the preset's, or eagle train's
    # defaults)
    config: str = ""
    head_type: str = ""  # model.head_type: eagle1 or eagle3
    draft_vocab: int | None = None  # model.draft_vocab
    steps: int | None = None  # loss.steps: unrolled steps of the training-time test
    batch_tokens: int | None = None  # optim.batch_tokens
    num_prompts: int | None = None  # eval.num_prompts: held-out prompts the main process decodes (the whole target)
    online: bool | None = None  # data.online: the target in the loop, no feature cache
    gpus: int = 0  # processes, one a GPU (0: this machine's devices; a CPU plan when there is no GPU)
    gpu_memory: float = 0.0  # GiB a GPU (0: this machine's free memory; for a CPU plan, the available RAM)
    json: bool = False  # one JSON object instead of the table


@dataclass
class Plan:
    feature_disk_bytes: int
    prep_peak_host_bytes: int
    prep_peak_device_bytes: int  # a GPU's, when the plan is for GPUs (0 on a CPU: all of it is host memory)
    train_peak_device_bytes: int
    max_batch_tokens: int
    device_bytes: int  # what one device has (GPU memory, or RAM for a CPU plan)
    rows: int
    tokens: int
    prep_parts: dict
    prep_device_parts: dict
    train_parts: dict
    target: dict
    head: dict
    processes: int
    device: str


def gib(n: float) -> str:
    return f"{n / 2**30:,.2f} GiB"


def rss_bytes() -> int:
    """This process's resident memory now (what a run starts from: the interpreter, torch, the data read). From
    /proc (ru_maxrss would carry a parent's peak across fork and exec)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * (1 if sys.platform == "darwin" else 1024)


def available_ram() -> int:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    import os

    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


def device_memory(cfg: PlanConfig) -> tuple[str, int, int]:
    """(device kind, bytes one device has, processes) for the plan: the GPUs named, or this machine's."""
    if cfg.gpus or cfg.gpu_memory:
        return "cuda", int((cfg.gpu_memory or 80) * 2**30), max(1, cfg.gpus)
    if torch.cuda.is_available():
        free, _ = torch.cuda.mem_get_info()
        return "cuda", free, torch.cuda.device_count()
    return "cpu", available_ram(), 1


def train_config(cfg: PlanConfig) -> TrainConfig:
    """The training run the plan is for: the preset `config`, with the plan's own keys over it."""
    keys = {"model.head_type": cfg.head_type or None, "model.draft_vocab": cfg.draft_vocab,
            "loss.steps": cfg.steps, "optim.batch_tokens": cfg.batch_tokens, "eval.num_prompts": cfg.num_prompts,
            "data.online": cfg.online, "model.dtype": None if cfg.dtype == "auto" else cfg.dtype}
    train = load_config(TrainConfig, cfg.config or None, [f"{k}={v}" for k, v in keys.items() if v is not None])
    if train.model.head_type not in ("eagle1", "eagle3"):
        raise PlanError(f"head_type {train.model.head_type!r}: expected eagle1 or eagle3")
    return train


def make_plan(cfg: PlanConfig) -> Plan:
    if not cfg.target:
        raise PlanError("name the target: --target DIR|HUB_ID|ALIAS")
    if bool(cfg.data) == bool(cfg.rows):
        raise PlanError("give the data (--data FILE|sharegpt) or a row count (--rows N --tokens-per-row T), one of "
                        "the two")
    train = train_config(cfg)
    kind, device_bytes, processes = device_memory(cfg)
    cuda = kind == "cuda"
    precision = Precision.of(train, torch.device(kind))
    tdtype = precision.target
    fdtype = default_dtype(tdtype) if cfg.feature_dtype == "auto" else resolve_dtype(cfg.feature_dtype)
    config, tok = target_config(cfg.target, tokenizer=bool(cfg.data))  # a row count needs no tokenizer
    size = TargetSize.of(config)
    given = {k: getattr(cfg, k) for k in ("max_length", "max_new_tokens", "regen_batch_size") if getattr(cfg, k)}
    prep = PrepConfig(target=cfg.target, data=cfg.data or "-", out="", max_rows=cfg.max_rows,
                      skip_rows=cfg.skip_rows, regenerate=cfg.regenerate, max_turns=cfg.max_turns, **given)
    # 1. the rows and their tokens (upper bounds where replies are still to be written)
    if cfg.data:
        prompts, rows = planned_rows(prep, tok)
    else:
        prompts = [cfg.tokens_per_row] * cfg.rows if cfg.regenerate else [0] * cfg.rows
        rows = [cfg.tokens_per_row + (prep.max_new_tokens if cfg.regenerate else 0)] * cfg.rows
    if not rows:
        raise PlanError(f"data {cfg.data!r}: no row would be kept (too long for max_length {prep.max_length}?)")
    # 2. prep: regeneration on the device the plan is for (the target's weights and batch on a GPU, else in RAM)
    one_turn = cfg.regenerate and cfg.max_turns == 1
    runtime = rss_bytes()  # torch, transformers, the tokenizer and the conversations read: as prep starts
    prep_need = prep_needs(size, prompts if cfg.regenerate else [], prep.max_new_tokens, prep.regen_batch_size,
                           tdtype.itemsize, fdtype.itemsize, on_host=not cuda, keep_features=one_turn,
                           runtime=runtime, prefill_tokens=PREFILL_TOKENS)
    # 3. training: the main process's device (it also decodes the held-out prompts, with the whole target)
    if train.loss.positions == "all":
        scored = 1.0
    else:  # the assistant tokens: replies of max_new_tokens at most
        scored = min(1.0, (sum(r - p for r, p in zip(rows, prompts)) if cfg.regenerate else sum(rows))
                     / max(1, sum(rows)))
    head, kw = step_needs(train, size, precision, cuda, scored, processes, main=True)
    train_need = train_needs(size, head, train.optim.batch_tokens, runtime=0 if cuda else runtime, **kw)
    # EAGLE-3's training store holds the last hidden state and the three fused layers; prep's (one-turn
    # regeneration) the last alone, which an EAGLE-1 head trains on
    store = 0 if train.data.online else sum(rows) * head.feature_width * fdtype.itemsize
    disk = prep_need.feature_disk + (store if head.head_type == "eagle3" or not one_turn else 0)
    return Plan(
        feature_disk_bytes=disk, prep_peak_host_bytes=prep_need.host.total,
        prep_peak_device_bytes=prep_need.device.total, train_peak_device_bytes=train_need.total,
        device_bytes=device_bytes, max_batch_tokens=largest_batch_tokens(size, head, device_bytes, **kw),
        rows=len(rows), tokens=sum(rows), prep_parts=prep_need.host.parts,
        prep_device_parts=prep_need.device.parts, train_parts=train_need.parts,
        target={"params": size.params, "outside_layers": size.outside_layers, "hidden": size.hidden,
                "layers": size.layers, "vocab": size.vocab, "dtype": str(tdtype).removeprefix("torch.")},
        head={"type": head.head_type, "params": head.params, "draft_vocab": head.draft_vocab,
              "steps": train.loss.steps, "batch_tokens": train.optim.batch_tokens,
              "feature_dtype": str(fdtype).removeprefix("torch."), "num_prompts": train.eval.num_prompts},
        processes=processes, device=kind)


def step_needs(cfg: TrainConfig, size: TargetSize, precision: Precision, cuda: bool, scored: float,
               processes: int, main: bool) -> tuple[HeadSize, dict]:
    """The head of a training config and the keywords of `eagle.memory.train_needs` for one of its processes: its
    dtypes, steps, positions, processes, and (`main`, validation decoding prompts) the whole target."""
    head = HeadSize.of(size, cfg.model.head_type, cfg.model.num_layers, cfg.model.draft_vocab)
    return head, dict(steps=cfg.loss.steps, unroll_fraction=cfg.loss.unroll_fraction, online=cfg.data.online,
                      target_bytes=precision.target.itemsize, head_bytes=precision.head.itemsize,
                      compute_bytes=precision.compute.itemsize if precision.compute else None, cuda=cuda,
                      scored=scored, processes=processes, decode=main and cfg.eval.num_prompts > 0)


def parts(d: dict) -> str:
    return ", ".join(f"{k.replace('_', ' ')} {gib(v)}" for k, v in d.items() if v)


def report(p: Plan) -> str:
    t, h = p.target, p.head
    where = f"its GPU of {gib(p.device_bytes)} ({p.processes} process{'es' if p.processes > 1 else ''}, one a GPU)" \
        if p.device == "cuda" else f"the CPU ({gib(p.device_bytes)} of RAM available)"
    fits = "fits" if p.train_peak_device_bytes <= p.device_bytes else "DOES NOT FIT"
    return "\n".join([
        f"target: {t['params'] / 1e9:,.2f}B parameters ({t['outside_layers'] / 1e9:,.2f}B outside the decoder "
        f"layers), hidden {t['hidden']:,}, {t['layers']} layers, vocabulary {t['vocab']:,}, {t['dtype']}",
        f"data: {p.rows:,} rows, {p.tokens:,} tokens at most",
        f"features on the disk: {gib(p.feature_disk_bytes)} ({h['feature_dtype']})",
        f"prep's peak host memory: {gib(p.prep_peak_host_bytes)} ({parts(p.prep_parts)})"
        + (f"; on its GPU: {gib(p.prep_peak_device_bytes)} "
           f"({'fits' if p.prep_peak_device_bytes <= p.device_bytes else 'DOES NOT FIT one GPU'}; "
           f"{parts(p.prep_device_parts)})" if p.prep_peak_device_bytes else ""),
        f"training, each process on {where}: {gib(p.train_peak_device_bytes)} ({fits}; {parts(p.train_parts)}), "
        f"{h['type']} head of {h['params'] / 1e6:,.1f}M parameters, draft vocabulary {h['draft_vocab']:,}, "
        f"{h['steps']} step{'s' if h['steps'] > 1 else ''}, optim.batch_tokens {h['batch_tokens']:,}",
        f"largest optim.batch_tokens that fits: {p.max_batch_tokens:,}",
    ])


def plan_command(cfg: PlanConfig) -> int:
    p = make_plan(cfg)
    if cfg.json:
        print(json.dumps(p.__dict__))
    else:
        print(report(p))
    return 0


def scored_share(cfg: TrainConfig) -> float:
    """The share of a batch's positions the loss scores: all of them, or (loss.positions assistant) the prepared
    rows' assistant share as prep counted it (its summary.json; 1 where there is none)."""
    if cfg.loss.positions == "all":
        return 1.0
    try:
        return float(json.loads((Path(cfg.data.prepared) / "summary.json").read_text())["masked_fraction"])
    except (OSError, ValueError, KeyError, TypeError):
        return 1.0


def check_training_fits(cfg: TrainConfig, size: TargetSize, device: torch.device, precision: Precision,
                        ranks: Ranks) -> None:
    """Refuse, in one line and before the target loads, a training run whose process needs more memory than its
    device has free (`eagle.memory.train_needs`: the target part, the head, its AdamW states, a step's
    activations; on the main process, the whole target when validation decodes prompts), naming both numbers and
    what would fit. On a CPU the processes share the machine's memory."""
    cuda = device.type == "cuda"
    # on a CPU what this process holds already (interpreter, torch) is not in the available memory, nor in the need
    free = torch.cuda.mem_get_info(device)[0] if cuda else available_ram() // ranks.count
    head, kw = step_needs(cfg, size, precision, cuda, scored_share(cfg), ranks.count, ranks.main)
    need = train_needs(size, head, cfg.optim.batch_tokens, **kw)
    if need.total > free:
        n = largest_batch_tokens(size, head, free, **kw)
        hint = f"lower optim.batch_tokens to {n:,} or less" if n else "no batch fits: use a device with more memory"
        if need.parts["decoding_target"] and need.parts["decoding_target"] > need.total - free:
            hint = "eval.num_prompts=0 leaves the whole target, which decodes the held-out prompts, out; or " + hint
        raise PlanError(f"training needs {gib(need.total)} on {device} ({parts(need.parts)}), {gib(free)} free: "
                        f"{hint}")


def check_pass_fits(size: TargetSize, device: torch.device, target_bytes: int, width: int) -> None:
    """Refuse, in one line, a feature pass whose target (its decoder layers beside the ends already loaded) and
    batch the device cannot hold."""
    free = torch.cuda.mem_get_info(device)[0] if device.type == "cuda" else available_ram()
    need = pass_needs(size, target_bytes, width)
    if need.total > free:
        raise PlanError(f"the feature pass needs {gib(need.total)} more on {device} ({parts(need.parts)}), "
                        f"{gib(free)} free: prepare the features where the whole target fits (eagle prep "
                        "--regenerate keeps them), or train online on a target spread over devices "
                        "(data.online=true model.device_map=auto)")
