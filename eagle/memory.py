"""What a run needs, worked out before anything runs from the target's config alone (the model built on the `meta`
device: every parameter's shape, no memory): the features' bytes on the disk, regeneration's peak host memory, and a
training process's peak device memory, part by part. `eagle plan` prints it; `eagle prep` refuses features the disk
cannot hold and `eagle train` a head the device cannot hold with the same arithmetic.

    size = TargetSize.of(config)                                       # or TargetSize.of_module(model)
    prep = prep_needs(size, prompt_tokens, max_new_tokens=256, batch=32, target_bytes=2, feature_bytes_per_value=2)
    prep.host.total, prep.device.total, prep.feature_disk
    need = train_needs(size, HeadSize.of(size, "eagle3", draft_vocab=32000), batch_tokens=8192, steps=7)
    need.total, need.parts                                             # bytes; {part: bytes}
    largest_batch_tokens(size, head, free_bytes, ...)                  # what optim.batch_tokens fits

The activation terms count the tensors a step keeps for its backward pass, per token, from the shapes the head's
forward makes (its layer: q, k, v, the attention output, the MLP's gate, up and product; the logits over the draft
vocabulary four times: q's logits and log-probabilities, p, and their gradient). They were checked against measured
peak memory on the CPU (benchmarks/memory_scale.py, BENCHMARKS.md); a GPU adds its CUDA context and allocator
slack, which `CUDA_CONTEXT` and `ALLOCATOR_SLACK` stand for.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from torch import nn

CUDA_CONTEXT = 600 << 20  # bytes a CUDA process holds before any tensor (context, kernels), as nvidia-smi shows
ALLOCATOR_SLACK = 1.10  # torch's caching allocator keeps freed blocks: peak reserved over peak allocated


def _count(model: nn.Module) -> tuple[int, int, int]:
    """(all parameters, those outside the decoder layers, one decoder layer's) of a causal LM; tied ones once."""
    layers = model.get_decoder().layers
    total = sum(p.numel() for p in model.parameters())
    inside = sum(p.numel() for p in layers.parameters())
    return total, total - inside, inside // max(1, len(layers))


@dataclass
class TargetSize:
    """A target's shapes and parameter counts."""

    hidden: int
    layers: int
    vocab: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    params: int  # every parameter, tied ones once
    outside_layers: int  # embedding, final norm, lm_head: all that training on cached features loads
    per_layer: int

    @classmethod
    def of(cls, config) -> "TargetSize":
        """From a transformers config (the model's, or its text config), the model built on the meta device."""
        from transformers import AutoModelForCausalLM

        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
        return cls.of_module(model)

    @classmethod
    def of_module(cls, model: nn.Module) -> "TargetSize":
        c = model.config.get_text_config(decoder=True)
        heads = c.num_attention_heads
        kv = getattr(c, "num_key_value_heads", None) or heads
        hd = getattr(c, "head_dim", None) or c.hidden_size // heads
        total, outside, per_layer = _count(model)
        vocab = model.get_output_embeddings().weight.shape[0]
        inter = getattr(c, "intermediate_size", None) or 4 * c.hidden_size
        return cls(c.hidden_size, c.num_hidden_layers, vocab, heads, kv, hd, inter, total, outside, per_layer)

    @property
    def kv_dim(self) -> int:
        return self.kv_heads * self.head_dim


@dataclass
class HeadSize:
    """A draft head's trainable parameters (counted on the meta device) and its draft vocabulary."""

    head_type: str
    params: int
    draft_vocab: int  # rows of its logits: the reduced vocabulary, or the target's whole one
    feature_width: int  # the cached features a training row reads: H (EAGLE-1/2) or 4H (EAGLE-3: last + 3 layers)
    reduced: bool  # a reduced vocabulary: the head keeps its own copy of the target's lm_head rows

    @classmethod
    def of(cls, size: TargetSize, head_type: str = "eagle1", num_layers: int = 1, draft_vocab: int = 0) -> "HeadSize":
        from eagle.head import make_head
        from eagle.head_config import HeadConfig, eagle3_layers

        layers = eagle3_layers(size.layers) if head_type == "eagle3" else [-1]
        cfg = HeadConfig(head_type=head_type, hidden_size=size.hidden, vocab_size=size.vocab,
                         num_attention_heads=size.heads, num_key_value_heads=size.kv_heads, head_dim=size.head_dim,
                         intermediate_size=size.intermediate, num_layers=num_layers, feature_layer_ids=layers,
                         draft_vocab_size=draft_vocab)
        with torch.device("meta"):
            head = make_head(cfg)
        params = sum(v.numel() for k, v in head.trainable_state_dict().items() if v.is_floating_point())
        width = size.hidden * (1 + len(layers)) if head_type == "eagle3" else size.hidden
        return cls(head_type, params, draft_vocab or size.vocab, width, bool(draft_vocab))


@dataclass
class Needs:
    """Bytes by part, and their sum."""

    parts: dict[str, int] = field(default_factory=dict)

    @property
    def total(self) -> int:
        return sum(self.parts.values())


def _cap(n: int) -> int:
    """The positions a preallocated KV-cache layer reserves for `n` (eagle.target.PreallocatedLayer)."""
    return max(256, 1 << math.ceil(math.log2(max(n, 1))))


def feature_bytes(row_tokens: list[int], width: int, dtype_bytes: int) -> int:
    return sum(row_tokens) * width * dtype_bytes


@dataclass
class PrepNeeds:
    host: Needs  # peak host memory, by part (everything, when the target runs on the CPU)
    device: Needs  # peak GPU memory, by part (nothing, when the target runs on the CPU)
    feature_disk: int  # the features regeneration writes


def prep_needs(size: TargetSize, prompt_tokens: list[int], max_new_tokens: int, batch: int, target_bytes: int,
               feature_bytes_per_value: int, on_host: bool = True, keep_features: bool = True,
               runtime: int = 0, prefill_tokens: int = 4096) -> PrepNeeds:
    """One-turn regeneration of prompts of `prompt_tokens` tokens (replies of at most `max_new_tokens`, batches of
    `batch` prompts of similar length, prefilled in chunks of about `prefill_tokens` tokens). `on_host`: the target
    runs on the CPU, so its weights and the batch's working tensors are in host memory; else on a GPU. `runtime`:
    the process before any of it (the interpreter, torch, the tokenizer, the conversations read)."""
    H, V = size.hidden, size.vocab
    order = sorted(prompt_tokens)
    worst, rows_on_host = Needs(), 0
    for b in range(0, len(order), batch):
        rows = order[b: b + batch]
        B, P = len(rows), rows[-1]
        L = P + max_new_tokens
        parts = {
            # the batch's KV cache: every layer's keys and values for the longest row, in preallocated buffers
            "kv_cache": B * _cap(L) * size.layers * 2 * size.kv_dim * target_bytes,
            # one layer's prefill of one chunk at a time: hidden, residual, norm, q, k, v, attention out; the MLP's
            # gate, up, product
            "prefill": B * min(P, max(1, prefill_tokens // B)) * (5 * H + 2 * size.kv_dim + 3 * size.intermediate)
            * target_bytes,
            "logits": B * V * 4,
        }
        if sum(parts.values()) > worst.total:
            worst = Needs(parts)
        # each row's features on the host as they come, and a prefill chunk's copy
        rows_on_host = max(rows_on_host, (B * L + min(B * P, prefill_tokens)) * H * feature_bytes_per_value
                           if keep_features else 0)
    model = {"target": size.params * target_bytes, **worst.parts}
    host = {"runtime": runtime, **(model if on_host else {}), "feature_rows": rows_on_host}
    disk = feature_bytes([p + max_new_tokens for p in prompt_tokens], H, feature_bytes_per_value) \
        if keep_features else 0
    return PrepNeeds(Needs(host), Needs({} if on_host else {"runtime": CUDA_CONTEXT, **model}), disk)


def train_needs(size: TargetSize, head: HeadSize, batch_tokens: int, steps: int = 1, unroll_fraction: float = 1.0,
                online: bool = False, target_bytes: int = 2, head_bytes: int = 4, compute_bytes: int | None = None,
                cuda: bool = False, runtime: int = 0, scored: float = 1.0, processes: int = 1,
                decode: bool = False) -> Needs:
    """One training process's peak device memory, by part: the target (embedding, final norm and lm_head on cached
    features; all of it online), the head's weights, gradients and AdamW states in `head_bytes`, its copy of the
    draft vocabulary's lm_head rows, and what a step of `batch_tokens` padded tokens keeps for its backward pass
    (`steps` unrolled steps of the training-time test, steps 2.. on `unroll_fraction` of the positions; logits on
    the `scored` share of the positions: all, or the assistant tokens, `loss.positions`). With several `processes`
    the gradients' all-reduce buffers; with `decode` (the main process when validation decodes prompts) the
    target's decoder layers too."""
    H, I, T, Vd = size.hidden, size.intermediate, batch_tokens, head.draft_vocab
    c = compute_bytes or head_bytes
    kvd = size.kv_dim
    target = (size.params if online else size.outside_layers) * target_bytes
    # per position of a step: the layer's inputs and outputs (fc in 2H or 3H, q, k, v, attention out, o, residual,
    # norms: ~12 H-wide tensors) and the MLP's four I-wide ones, kept in the products' dtype, and in the head's
    # dtype where autocast copies them
    layer = (12 * H + 2 * kvd + 4 * I) * (c + (head_bytes if c != head_bytes else 0))
    logits = int(4 * Vd * 4 * scored)  # q's logits and log-probabilities, p, and the gradient: float32
    rows_after = max(1, math.ceil(unroll_fraction * T)) if steps > 1 else 0
    unrolled = (steps - 1) * rows_after * (layer + logits)
    # the unrolled steps' keys and values, concatenated a step at a time, and each step's mask over them
    keys = sum(s * T for s in range(1, steps + 1)) * 2 * kvd * c if steps > 1 else 0
    mask = sum(rows_after * (T + (s - 1) * rows_after) * (1 + (c if cuda else 0)) for s in range(2, steps + 1))
    parts = {
        "runtime": runtime + (CUDA_CONTEXT if cuda else 0),
        "target": target,
        "head_weights": head.params * head_bytes,
        "head_gradients": head.params * head_bytes,
        "adamw_states": 2 * head.params * head_bytes,
        "draft_lm_rows": Vd * H * target_bytes if head.reduced else 0,
        # autocast keeps a copy of each weight in the products' dtype for the step
        "autocast_weights": head.params * c if c != head_bytes else 0,
        "batch_features": T * head.feature_width * (4 + head_bytes),
        "activations": T * (layer + logits) + unrolled,
        "unrolled_attention": keys + mask,
        # train.parallel.average_gradients: one float32 vector of every gradient, then the averaged ones
        "allreduce_buffers": head.params * (4 + head_bytes) if processes > 1 else 0,
        "decoding_target": (size.params - size.outside_layers) * target_bytes if decode and not online else 0,
    }
    if cuda:
        parts["allocator_slack"] = int((sum(parts.values()) - parts["runtime"]) * (ALLOCATOR_SLACK - 1))
    return Needs(parts)


def pass_needs(size: TargetSize, target_bytes: int, width: int, tokens: int = 4096) -> Needs:
    """A feature pass's memory beyond the target's embedding, norm and lm_head: its decoder layers and one batch of
    `tokens` padded tokens (the activations of a layer at a time, and the `width` features kept)."""
    return Needs({"decoder_layers": (size.params - size.outside_layers) * target_bytes,
                  "pass_batch": tokens * ((5 * size.hidden + 2 * size.kv_dim + 3 * size.intermediate) * target_bytes
                                          + width * target_bytes + size.hidden * target_bytes)})


def largest_batch_tokens(size: TargetSize, head: HeadSize, free: int, step: int = 64, **kw) -> int:
    """The largest `optim.batch_tokens` (a multiple of `step`) whose `train_needs` fits in `free` bytes; 0 if none."""
    lo, hi = 0, 1 << 22
    while hi - lo > step:
        mid = (lo + hi) // 2 // step * step
        if train_needs(size, head, mid, **kw).total <= free:
            lo = mid
        else:
            hi = mid
    return lo
