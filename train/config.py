"""The training config: one nested dataclass is the schema for YAML presets, CLI overrides and Python.

    from train.config import TrainConfig
    from eagle.configio import load_config
    cfg = load_config(TrainConfig, "configs/smollm2-135m-eagle1.yaml", ["budget.minutes=5"])
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch

from cpu_backend import CPUConfig
from eagle.checkpoint import check_head_dir
from eagle.device import resolve_device, resolve_dtype
from eagle.features import DTYPES as FEATURE_DTYPES


@dataclass
class ModelConfig:
    target: str = "smollm2-135m"
    head_type: str = "eagle1"  # eagle1 (EAGLE-1/2: last features, feature regression) | eagle3 (three layers, TTT)
    # EAGLE-3: the target layers fused, indexed like transformers' hidden_states (empty: 2, L // 2, L - 3)
    feature_layers: list[int] = field(default_factory=list)
    # "identity": fc passes the feature through; "target_last_layer": the decoder layer starts as the target's
    # last layer; "random": from scratch
    init: str = "identity"
    num_layers: int = 1  # decoder layers of an EAGLE-1/2 head (EAGLE's: one; EAGLE-3 heads have one)
    # an EAGLE-1/2 head's fc bias (EAGLE's original heads have one). vLLM's EAGLE-1 model has none and `eagle export
    # --for vllm` refuses a head with one: false, so every engine serves the head (BENCHMARKS.md measures the cost)
    fc_bias: bool = False
    # EAGLE-3.1 (arXiv 2605.09992; eagle3 heads): an RMSNorm on each fused target layer before fc, and the normed
    # output fed to the next draft step. vLLM serves both (`fc_norm`, `norm_output` in the speculators format).
    fc_norm: bool = False
    norm_output: bool = False
    # Draft over the n most frequent assistant tokens of the training rows (0: the whole vocabulary). Cuts the
    # lm_head cost of both training and drafting.
    draft_vocab: int = 0
    # Where the draft vocabulary's token frequencies come from besides the training rows: a conversation source
    # (the `sharegpt` alias, a JSON / JSONL file) whose first `vocab_count_rows` rows' assistant turns are tokenized
    # and counted, each source weighing half ("": the training rows alone). A few hundred regenerated rows miss
    # many tokens the target writes: on 20 MT-bench replies the 4,096 most frequent tokens of the demo's rows cover
    # 82 % of the target's tokens, the 8,192 most frequent of 6,000 ShareGPT rows 90 %, 16,384 96 % (BENCHMARKS.md).
    vocab_counts: str = ""
    vocab_count_rows: int = 6000
    # the target's weights: auto (bfloat16 on CUDA, float32 elsewhere), float32, bfloat16, float16
    dtype: str = "auto"
    # the head's weights and AdamW states (master weights), whatever the target's: float32 unless memory is short
    # (`mixed_precision` picks the precision of the products)
    head_dtype: str = "float32"
    # the head written to `out`: auto (the target's dtype, as published heads are), float32, bfloat16, float16;
    # checkpoints keep the master weights as they are, so a resumed run goes on exactly
    save_dtype: str = "auto"
    # "auto": the target spread over every GPU (and the CPU) by transformers / accelerate, for online training
    # (`data.online`) with a target larger than one GPU; "": the target whole on `device`. Untested on GPUs.
    device_map: str = ""


@dataclass
class DataConfig:
    prepared: str = "runs/demo/data"  # a directory written by `eagle prep`; validation rows come from here
    # more prepared directories whose train rows are added (e.g. raw ShareGPT rows beside regenerated ones)
    extra: list[str] = field(default_factory=list)
    # "mixed": each epoch shuffles the rows of every directory together; "extra_first": each epoch trains on the
    # `extra` rows before the `prepared` ones (e.g. raw ShareGPT rows first, the target's own rows last). A batch
    # never mixes the two then; with more rows than the budget reaches, the prepared rows come last in the run.
    order: str = "mixed"
    max_length: int = 1024  # longer training rows are cut (the loss mask is cut with them)
    # online: run the target on every batch (no feature cache on disk; slower); else features are computed once
    # and cached beside the prepared rows
    online: bool = False
    # the cached features' dtype: auto (a complete store the target already has for the rows, e.g. prep's, in its
    # dtype; else the target's dtype), float32, or bfloat16 / float16 for half the memory and disk (an EAGLE-3
    # head's over 2M SmolLM2 tokens: 19 GB in float32); batches are in the head's dtype either way
    feature_dtype: str = "auto"
    # the precision the target computes missing features in: "target" (as loaded: model.dtype), "bfloat16" (a
    # bfloat16 copy of the target: ~3x the tokens/s on a CPU with AMX; features within ~2 % of float32 ones), or
    # "auto" (bfloat16 on a CPU that multiplies it natively, AMX or AVX-512 BF16, else the target as loaded). Stores
    # the target itself wrote (e.g. prep's, from regeneration) are used first; held-out rows always get the target's
    # own, so the simulated tau stays exact.
    feature_pass: str = "target"
    # a training row is left out when it holds this share of a validation row's distinct reply 8-grams (a near
    # repeat: same reply to a reworded prompt), as well as when it is identical to one; above 1: identical only
    val_overlap: float = 0.5
    # processes that read and collate batches ahead of the step (torch's DataLoader): -1 picks what measured
    # fastest, 0 on a CPU (2 cores: a worker takes a core from the step) and 4 on a GPU
    workers: int = -1
    # padded tokens a batch of the feature pass holds (its activations: a layer's of that many tokens)
    pass_tokens: int = 4096


@dataclass
class OptimConfig:
    lr: float = 1e-3
    weight_decay: float = 0.0
    # residual dropout in the head's decoder layers (attention and MLP outputs) while training, against learning a
    # few thousand rows by heart (0: none; never while validating or decoding)
    dropout: float = 0.0
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])
    warmup_steps: int = 20
    grad_clip: float = 0.5
    batch_tokens: int = 8192  # padded tokens per batch (rows of similar length are batched together)
    # micro-batches per optimizer step on each process: a step sees accumulate x processes batches (train.parallel)
    accumulate: int = 1


@dataclass
class LossConfig:
    feature_weight: float = 1.0  # smooth-L1 on the next feature (EAGLE-1/2 heads only; EAGLE-3 uses CE alone)
    ce_weight: float = 0.1  # cross-entropy against the target's distribution
    # "p": the cross-entropy's target is the target's whole distribution p; "argmax": p's top token alone (the one
    # greedy verification accepts), so the head's capacity goes to ranking that token first
    ce_target: str = "p"
    # the distribution term (weighted ce_weight): "kl", the cross-entropy above (against p: the KL divergence plus a
    # constant); "lk", minus the log of the acceptance rate sum_x min(p(x), q(x)) that sampled verification gives
    # (the LK losses' log-acceptance form, arXiv 2602.23881), which aims the head's capacity at acceptance itself
    divergence: str = "kl"
    noise: float = 0.2  # width of the uniform noise added to input features (EAGLE: U(-0.1, 0.1))
    # Unrolled draft steps: step s reads the head's own step s-1 predictions as features, attending to the true
    # features before them as when drafting (EAGLE-3's training-time test). Step s is weighted step_decay^(s-1).
    steps: int = 1
    step_decay: float = 0.8
    # Steps 2.. on this fraction of the positions only: random chain starts, each unrolled as drafting from it
    # would (1.0: every position, the dense test). Step 1 always trains on every position; validation is dense.
    unroll_fraction: float = 1.0
    # Which positions are scored: "assistant" (the next token is an assistant token, i.e. the target's own text when
    # the rows were regenerated) or "all" (prompt and template positions too: the label is the target's p there as
    # well, so they are more examples of the same mapping from features to the next feature and distribution).
    # Validation always scores assistant positions.
    positions: str = "assistant"


@dataclass
class BudgetConfig:
    max_steps: int = 0  # 0: no step limit
    minutes: float = 0.0  # 0: no time limit
    epochs: float = 0.0  # 0: no epoch limit


@dataclass
class EvalConfig:
    every_minutes: float = 3.0  # validate this often (0: only at the end); the best checkpoint is kept
    num_prompts: int = 4  # held-out prompts decoded speculatively (a check of the simulated tau on a few prompts)
    max_new_tokens: int = 64
    num_speculative_tokens: int = 4  # k of the chain decoding simulated along every held-out row (picks the best head)


@dataclass
class TrainConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    loss: LossConfig = field(default_factory=LossConfig)
    budget: BudgetConfig = field(default_factory=BudgetConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    # auto (CUDA when present), cpu, cuda, cuda:N; under `accelerate launch` each process takes its own GPU
    device: str = "auto"
    # how many processes trained (`accelerate launch`, `torchrun`): written by the run into its config.yaml; a run
    # resumes with the same number (0 in a config: whatever was launched)
    num_processes: int = 0
    run_dir: str = "runs/demo/train"  # checkpoints, logs, resolved config
    out: str = "runs/demo/head"  # the best head, as a loadable checkpoint directory
    save_every_minutes: float = 2.0
    log_every: int = 10
    tensorboard: bool = True  # also TensorBoard scalars in run_dir/tensorboard, when the package is installed
    seed: int = 0
    num_threads: int = 0  # torch threads (0: torch's default)
    # the CPU backend: on the CPU, the head's linear layers (forward and backward) and validation decoding through
    # the packed C kernel (`cpu.fast_path`); false: torch's own products throughout
    cpu: CPUConfig = field(default_factory=CPUConfig)
    # "bf16" / "fp16": the training step's products in bfloat16 / float16 under autocast (weights, optimizer state,
    # losses and validation stay in model.head_dtype; fp16 scales the loss so small gradients do not vanish), as on
    # GPUs; the packed kernel is then not used for training. On a 2-core CPU with AMX bf16 made fewer steps a
    # minute than float32 (each new batch shape builds a new kernel; BENCHMARKS.md). "none": the head's dtype
    # throughout. "auto": bf16 on CUDA, none elsewhere
    mixed_precision: str = "auto"


class TrainError(ValueError):
    """A training config or run that cannot work; the message names the key or the file, in one line."""


def check_config(cfg: TrainConfig) -> None:
    """One-line TrainErrors for settings that cannot work, and for a run_dir or out that must not be used: before
    any time is spent (an `out` holding anything but a head is never replaced)."""
    if cfg.model.head_type not in ("eagle1", "eagle3"):
        raise TrainError(f"model.head_type {cfg.model.head_type!r}: expected eagle1 or eagle3")
    if cfg.data.order not in ("mixed", "extra_first"):
        raise TrainError(f"data.order {cfg.data.order!r}: expected mixed or extra_first")
    if cfg.loss.ce_target not in ("p", "argmax"):
        raise TrainError(f"loss.ce_target {cfg.loss.ce_target!r}: expected p or argmax")
    if cfg.loss.divergence not in ("kl", "lk"):
        raise TrainError(f"loss.divergence {cfg.loss.divergence!r}: expected kl or lk")
    if cfg.loss.divergence == "lk" and cfg.loss.ce_target != "p":
        raise TrainError(f"loss.divergence lk compares q with the whole of p; loss.ce_target "
                         f"{cfg.loss.ce_target!r} does not apply (leave it p)")
    if cfg.loss.positions not in ("assistant", "all"):
        raise TrainError(f"loss.positions {cfg.loss.positions!r}: expected assistant or all")
    if (cfg.model.fc_norm or cfg.model.norm_output) and cfg.model.head_type != "eagle3":
        raise TrainError("model.fc_norm / model.norm_output (EAGLE-3.1) are options of eagle3 heads: set "
                         "model.head_type=eagle3")
    if cfg.model.num_layers < 1 or (cfg.model.head_type == "eagle3" and cfg.model.num_layers != 1):
        raise TrainError(f"model.num_layers {cfg.model.num_layers}: expected >= 1 for eagle1 heads, 1 for eagle3")
    if not 0.0 < cfg.loss.unroll_fraction <= 1.0:
        raise TrainError(f"loss.unroll_fraction {cfg.loss.unroll_fraction}: expected a fraction in (0, 1]")
    if not (cfg.budget.max_steps or cfg.budget.minutes or cfg.budget.epochs):
        raise TrainError("set a budget: budget.max_steps, budget.minutes or budget.epochs")
    if cfg.data.feature_pass not in ("target", "bfloat16", "auto"):
        raise TrainError(f"data.feature_pass {cfg.data.feature_pass!r}: expected target, bfloat16 or auto")
    if cfg.data.feature_dtype not in ("auto", *FEATURE_DTYPES):
        raise TrainError(f"data.feature_dtype {cfg.data.feature_dtype!r}: expected auto or one of "
                         f"{', '.join(FEATURE_DTYPES)}")
    resolve_device(cfg.device), resolve_dtype(cfg.model.head_dtype)  # one-line DeviceErrors
    resolve_dtype(cfg.model.dtype, cfg.device), resolve_dtype(cfg.model.save_dtype, cfg.device)
    if cfg.mixed_precision not in ("auto", "none", "bf16", "fp16"):
        raise TrainError(f"mixed_precision {cfg.mixed_precision!r}: expected auto, none, bf16 or fp16")
    if cfg.mixed_precision == "fp16" and resolve_dtype(cfg.model.head_dtype) == torch.float16:
        raise TrainError("mixed_precision fp16 scales the loss for float32 master weights; model.head_dtype float16 "
                         "has none: set model.head_dtype=float32")
    if cfg.model.init not in ("identity", "target_last_layer", "random"):
        raise TrainError(f"model.init {cfg.model.init!r} is not one of identity, target_last_layer, random")
    if cfg.optim.accumulate < 1:
        raise TrainError(f"optim.accumulate {cfg.optim.accumulate}: expected at least 1 micro-batch a step")
    if not 0.0 <= cfg.optim.dropout < 1.0:
        raise TrainError(f"optim.dropout {cfg.optim.dropout}: expected a rate >= 0 and < 1")
    if not 0 <= cfg.optim.lr <= torch.finfo(torch.float32).max:  # else AdamW's step fails with a RuntimeError
        raise TrainError(f"optim.lr {cfg.optim.lr}: expected a number >= 0 that float32 holds")
    negative = [f"budget.{k} {v}" for k, v in vars(cfg.budget).items() if v < 0]
    if negative:
        raise TrainError(f"{', '.join(negative)}: a budget cannot be negative (0: no limit of that kind)")
    run, out = Path(cfg.run_dir), Path(cfg.out)
    if run.exists() and not run.is_dir():
        raise TrainError(f"run_dir {cfg.run_dir!r} is a file: name a directory for the checkpoints and logs")
    if out.resolve() == run.resolve() or out.resolve() in run.resolve().parents:
        raise TrainError(f"out {cfg.out!r} would hold run_dir {cfg.run_dir!r}: name a directory of its own for the "
                         "head")
    check_head_dir(out, "out ")
