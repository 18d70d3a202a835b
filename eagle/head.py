"""The EAGLE-1/2 draft head: one decoder layer that predicts the target's next feature.

    h[t] = fc(concat(embed(x[t+1]), f[t]))          # 2H -> H
    f_hat[t+1] = DecoderLayer(h)[t]                 # Llama layer without its input norm
    q(x[t+2]) = softmax(lm_head(f_hat[t+1]))        # the target's own lm_head, shared and frozen

`f` is the target's last hidden state after its final norm. The embedding and lm_head belong to the target: they
are attached with `head.attach(target)` and are never saved with the head. Checkpoints are a directory with
`config.json` + `model.safetensors` (see eagle/checkpoint.py).
"""

from __future__ import annotations

import math
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from eagle import interop
from eagle.checkpoint import CheckpointError, read_config, read_raw, read_weights, save_head
from eagle.device import resolve_device, resolve_dtype
from eagle.head_config import HeadConfig, eagle3_layers

__all__ = ["HeadConfig", "HeadCache", "EagleHead", "Eagle3Head", "make_head", "load_head", "eagle3_layers",
           "check_compatible"]

SHARED_PREFIXES = ("embed_tokens.", "lm_head.")


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        if x.dtype in (torch.bfloat16, torch.float16):  # 16-bit products under autocast: normalise in float32
            return self.forward(x.float()).to(x.dtype)
        var = x.pow(2).mean(-1, keepdim=True)
        return self.weight * (x * torch.rsqrt(var + self.eps))


_ROPE_TABLES: dict = {}  # (head_dim, theta, dtype, device) -> cos, sin [positions, head_dim]


def rope_table(head_dim: int, theta: float, dtype, device, positions: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin [>= positions, head_dim] of the rotary embedding at every position 0.. (each value computed
    alone in float64, then cast), one table per (head_dim, theta, dtype, device), grown by powers of two and kept:
    the CPU backend's draft steps read its rows by address."""
    key = (head_dim, theta, dtype, torch.device(device))
    table = _ROPE_TABLES.get(key)
    if table is None or table[0].shape[0] < positions:
        pos = torch.arange(max(4096, 1 << math.ceil(math.log2(max(positions, 1)))), device=device,
                           dtype=torch.float64)
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float64) / head_dim))
        freqs = pos[:, None] * inv_freq  # [positions, D/2]
        emb = torch.cat([freqs, freqs], dim=-1)
        table = _ROPE_TABLES[key] = (emb.cos().to(dtype), emb.sin().to(dtype))
    return table


def rope_cos_sin(position_ids: torch.Tensor, head_dim: int, theta: float, dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin [B, 1, T, D] of the rotary embedding at position_ids [B, T]: rows of `rope_table` (the same
    values as computing them on the spot), so a drafting step only gathers two rows."""
    need = int(position_ids.max()) + 1 if position_ids.numel() else 1
    cos, sin = rope_table(head_dim, theta, dtype, position_ids.device, need)
    return cos[position_ids][:, None], sin[position_ids][:, None]  # [B, 1, T, D]


def _rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


def draft_rows(weight: torch.Tensor, d2t: torch.Tensor) -> torch.Tensor:
    """The rows `d2t` of the target's lm_head `weight`, on d2t's device (the head's; the target's lm_head may sit on
    another device when it is spread over several)."""
    return weight[d2t.to(weight.device)].to(d2t.device).contiguous()


class HeadCache:
    """The head's own KV cache: preallocated buffers written at absolute positions (gpt-fast style).

    Rolling back drafted entries is `crop(n)`: stale entries past `length` are overwritten next time.
    """

    def __init__(self):
        self.k: list[torch.Tensor | None] = []  # per decoder layer, made by its first write
        self.v: list[torch.Tensor | None] = []
        self.length = 0

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor, start: int) -> tuple[torch.Tensor, torch.Tensor]:
        end = start + k.shape[2]
        while len(self.k) <= layer:
            self.k.append(None)
            self.v.append(None)
        if k.requires_grad:  # training (unrolled steps): keep autograd history, so no in-place writes
            old_k, old_v = (k[:, :, :0], v[:, :, :0]) if self.k[layer] is None else (self.k[layer], self.v[layer])
            self.k[layer] = torch.cat([old_k[:, :, :start], k], dim=2)
            self.v[layer] = torch.cat([old_v[:, :, :start], v], dim=2)
            return self.k[layer], self.v[layer]
        buf_k, buf_v = self.buffers(layer, k, k.shape[:2], k.shape[3], start, end)
        buf_k[:, :, start:end] = k
        buf_v[:, :, start:end] = v
        return buf_k[:, :, :end], buf_v[:, :, :end]

    def buffers(self, layer: int, like: torch.Tensor, heads: tuple, head_dim: int, start: int,
                end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer's key and value buffers [B, kv_heads, capacity >= end, D] (contiguous; heads = (B, kv_heads),
        dtype and device those of `like`), grown (keeping the first `start` positions) where they are short."""
        while len(self.k) <= layer:
            self.k.append(None)
            self.v.append(None)
        buf = self.k[layer]
        if buf is None or buf.shape[2] < end or buf.shape[0] != heads[0]:
            cap = max(256, 1 << math.ceil(math.log2(end)))
            nk = like.new_zeros(*heads, cap, head_dim)
            nv = torch.zeros_like(nk)
            if buf is not None and buf.shape[0] == heads[0]:
                nk[:, :, :start] = buf[:, :, :start]
                nv[:, :, :start] = self.v[layer][:, :, :start]
            self.k[layer], self.v[layer] = nk, nv
        return self.k[layer], self.v[layer]

    def crop(self, n: int) -> None:
        self.length = min(self.length, n)


class Attention(nn.Module):
    def __init__(self, cfg: HeadConfig, in_dim: int | None = None):
        super().__init__()
        self.nh, self.nkv, self.hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        in_dim = in_dim or cfg.hidden_size
        self.q_proj = nn.Linear(in_dim, self.nh * self.hd, bias=False)
        self.k_proj = nn.Linear(in_dim, self.nkv * self.hd, bias=False)
        self.v_proj = nn.Linear(in_dim, self.nkv * self.hd, bias=False)
        self.o_proj = nn.Linear(self.nh * self.hd, cfg.hidden_size, bias=False)

    def forward(self, x, cos, sin, cache: HeadCache | None, layer: int, mask: torch.Tensor | None):
        B, T, _ = x.shape
        q, k, v = (t.view(B, T, -1, self.hd).transpose(1, 2) for t in (self.q_proj(x), self.k_proj(x), self.v_proj(x)))
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        k, v, mask = self.with_cache(k, v, cache, layer, mask)
        if self.nkv != self.nh:
            k = k.repeat_interleave(self.nh // self.nkv, dim=1)
            v = v.repeat_interleave(self.nh // self.nkv, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.o_proj(out.transpose(1, 2).reshape(B, T, self.nh * self.hd))

    def with_cache(self, k, v, cache: HeadCache | None, layer: int, mask: torch.Tensor | None):
        """k and v [B, kv_heads, T, D] with the cached entries in front (written into `cache` at its length), and
        the mask: when none is given, causal over the new tokens, everything cached before them visible."""
        T, past = k.shape[2], 0
        if cache is not None:
            past = cache.length
            k, v = cache.write(layer, k, v, past)
        if mask is None and T > 1:
            mask = torch.ones(T, past + T, dtype=torch.bool, device=k.device).tril(past)
        return k, v, mask


class MLP(nn.Module):
    def __init__(self, cfg: HeadConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class BranchDropout(nn.Module):
    """Dropout on a residual branch's output while training (GPT-2's residual dropout): a share `p` of the entries
    zeroed, the rest scaled by 1 / (1 - p). The masks come from `gen` (set with the rate by `EagleHead.set_dropout`
    before each batch), so a resumed run draws what the uninterrupted one did. Off (p = 0) unless training sets it."""

    def __init__(self):
        super().__init__()
        self.p, self.gen = 0.0, None

    def forward(self, y):
        if not (self.training and self.p):
            return y
        keep = torch.rand(y.shape, generator=self.gen, device=self.gen.device if self.gen else "cpu") >= self.p
        return y * keep.to(y.device, y.dtype) / (1.0 - self.p)


class DecoderLayer(nn.Module):
    """A Llama decoder layer; the first one of an EAGLE-1/2 head has no input norm (the fc output feeds attention
    directly), later ones have it."""

    def __init__(self, cfg: HeadConfig, input_norm: bool = False):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps) if input_norm else None
        self.self_attn = Attention(cfg)
        self.mlp = MLP(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.dropout = BranchDropout()

    def forward(self, x, cos, sin, cache, layer, mask):
        a = x if self.input_layernorm is None else self.input_layernorm(x)
        h = x + self.dropout(self.self_attn(a, cos, sin, cache, layer, mask))
        return h + self.dropout(self.mlp(self.post_attention_layernorm(h)))


class EagleHead(nn.Module):
    """EAGLE-1/2 draft head. Contract: `embed`, `forward` (project + backbone), `logits`."""

    def __init__(self, config: HeadConfig):
        super().__init__()
        self.config = config
        H = config.hidden_size
        self.fc = nn.Linear(2 * H, H, bias=config.fc_bias)
        if config.num_layers < 1:
            raise ValueError(f"num_layers={config.num_layers}: a head has at least one decoder layer")
        self.layers = nn.ModuleList([DecoderLayer(config, input_norm=i > 0) for i in range(config.num_layers)])
        if config.draft_vocab_size:
            # draft token index -> target token id; saved with the head
            self.register_buffer("d2t", torch.arange(config.draft_vocab_size), persistent=True)
        # Shared with the target, frozen, not saved: set by attach().
        self.embed_tokens: nn.Module | None = None
        self.lm_head: nn.Module | None = None
        self.draft_lm_weight: torch.Tensor | None = None  # lm_head rows of the draft vocabulary

    # -- wiring to the target ------------------------------------------------------------------------------
    def attach(self, target) -> "EagleHead":
        """Share the target's embedding and lm_head after checking the head was made for this target."""
        check_compatible(self.config, target)
        self.embed_tokens = target.embed
        self.lm_head = target.lm_head
        self._gather_draft_rows()
        return self

    def set_draft_vocab(self, d2t: torch.Tensor) -> None:
        """Restrict drafting to the target tokens `d2t` (sorted ids), e.g. the most frequent ones in training data."""
        if not self.config.draft_vocab_size or d2t.shape != self.d2t.shape:
            raise ValueError(f"draft vocabulary of {d2t.shape[0]} ids does not fit draft_vocab_size="
                             f"{self.config.draft_vocab_size}")
        self.d2t.copy_(d2t)
        self._gather_draft_rows()

    def _gather_draft_rows(self) -> None:
        if self.lm_head is not None:
            w = self.lm_head.weight
            rows = draft_rows(w, self.d2t) if self.config.draft_vocab_size else w.to(self.fc.weight.device)
            self.draft_lm_weight = rows.detach()

    def init_from_target_layer(self, target, layer: int = -1) -> None:
        """Start the decoder layer from one of the target's layers (same shapes), a warm start for training."""
        src = target.layer_weights(layer)  # read alone from the checkpoint when the target's layers are not loaded
        own = self.layers[0].state_dict()
        self.layers[0].load_state_dict({k: src[k].to(v.dtype) for k, v in own.items() if k in src}, strict=False)

    def init_identity_fc(self) -> None:
        """fc passes the feature through (embedding half zero): the head starts by predicting f[t+1] = f[t] plus
        what its fresh layer adds, which keeps the target's large constant feature dimensions from the start."""
        H = self.config.hidden_size
        with torch.no_grad():
            self.fc.weight.zero_()
            self.fc.weight[:, H:] = torch.eye(H, dtype=self.fc.weight.dtype)
            if self.fc.bias is not None:
                self.fc.bias.zero_()

    def set_dropout(self, p: float, gen: torch.Generator | None = None) -> None:
        """Residual dropout of rate `p` in every decoder layer while the head is in training mode, masks drawn from
        `gen` (0: none; decoding and validation, in eval mode, never drop)."""
        if not 0.0 <= p < 1.0:
            raise ValueError(f"dropout {p}: expected 0 <= p < 1")
        for layer in self.layers:
            layer.dropout.p, layer.dropout.gen = p, gen

    def trainable_state_dict(self) -> dict[str, torch.Tensor]:
        return {k: v for k, v in self.state_dict().items() if not k.startswith(SHARED_PREFIXES)}

    # -- the draft-model contract --------------------------------------------------------------------------
    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        # a target spread over devices (device_map) may keep its embedding elsewhere than the head
        where = self.embed_tokens.weight.device
        return self.embed_tokens(input_ids.to(where)).to(input_ids.device)

    def forward(self, features: torch.Tensor, input_ids: torch.Tensor, position_ids: torch.Tensor,
                cache: HeadCache | None = None, mask: torch.Tensor | None = None) -> torch.Tensor:
        """features[t] and input_ids[t] (= x[t+1]) -> predicted feature f_hat[t+1]; [B, T, H]."""
        x = self.fc(torch.cat([self.embed(input_ids).to(features.dtype), features], dim=-1))
        cos, sin = rope_cos_sin(position_ids, self.config.head_dim, self.config.rope_theta, x.dtype)
        for i, layer in enumerate(self.layers):
            x = layer(x, cos, sin, cache, i, mask)
        if cache is not None:
            cache.length += input_ids.shape[1]
        return x

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Draft logits over the draft vocabulary (the full target vocabulary unless reduced): an EAGLE-1/2 head
        predicts target features, so they are the target's logits of its prediction."""
        return self.target_logits(hidden)

    def target_logits(self, features: torch.Tensor) -> torch.Tensor:
        """The target's logits over the draft vocabulary for target features [..., H]: its lm_head rows of the draft
        vocabulary (what training takes p from), in the lm_head's dtype (a float32 head may train beside a 16-bit
        target)."""
        return self.cap(F.linear(features.to(self.draft_lm_weight.dtype), self.draft_lm_weight))

    def cap(self, logits: torch.Tensor) -> torch.Tensor:
        """The target's logit soft-capping (Gemma-2's), where it has one."""
        c = self.config.logit_softcap
        return torch.tanh(logits / c) * c if c else logits

    def to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return self.d2t[draft_ids] if self.config.draft_vocab_size else draft_ids

    # -- checkpoints ---------------------------------------------------------------------------------------
    def save_pretrained(self, path, extra: dict | None = None) -> None:
        """config.json + model.safetensors in directory `path`, written whole (`eagle.checkpoint.save_head`)."""
        save_head(self, path, extra)

    @classmethod
    def from_pretrained(cls, path, device="cpu", dtype=torch.float32, target=None) -> "EagleHead":
        """Our checkpoint directory or a published EAGLE-1/2 / EAGLE-3 one (`eagle.interop`), on `device` (auto, cpu,
        cuda, cuda:N) in `dtype` (float32, bfloat16, float16; the d2t map stays integer)."""
        return load_head(path, device=device, dtype=dtype, target=target)


class Eagle3Layer(nn.Module):
    """EAGLE-3's decoder layer: attention reads concat(norm(embedding), norm(hidden)) (2H); the residual is the
    hidden stream."""

    def __init__(self, cfg: HeadConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)  # on the token embedding
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)  # on the fused feature / own hidden
        self.self_attn = Attention(cfg, in_dim=2 * cfg.hidden_size)
        self.mlp = MLP(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.dropout = BranchDropout()

    def forward(self, emb, x, cos, sin, cache, layer, mask):
        a = torch.cat([self.input_layernorm(emb), self.hidden_norm(x)], dim=-1)
        h = x + self.dropout(self.self_attn(a, cos, sin, cache, layer, mask))
        return h + self.dropout(self.mlp(self.post_attention_layernorm(h)))


class Eagle3Head(EagleHead):
    """EAGLE-3 draft head (Li et al. 2025):

        x[t] = fc(concat(low[t], mid[t], high[t]))          # 3H -> H, target features of three layers
        h[t] = Eagle3Layer(embed(x_tok[t+1]), x)[t]          # attention over concat(norm(emb), norm(x))
        q(x_tok[t+2]) = softmax(draft_head(norm(h[t])))      # its own lm_head over the draft vocabulary

    When drafting (and in the training-time test) the head's own h[t] replaces x at the next step: `forward`
    takes 3H-wide target features or H-wide hidden states and tells them apart by width. The draft vocabulary
    (`d2t`, draft index -> target id; `t2d`, target id -> in the draft vocabulary?) is saved with the head.
    """

    def __init__(self, config: HeadConfig):
        nn.Module.__init__(self)
        self.config = config
        if config.num_layers != 1:
            raise ValueError(f"num_layers={config.num_layers}: EAGLE-3 heads have one decoder layer")
        H, n_feats = config.hidden_size, len(config.feature_layer_ids)
        vocab = config.draft_vocab_size or config.vocab_size
        self.fc = nn.Linear(n_feats * H, H, bias=False)
        # EAGLE-3.1: each fused layer normed on its own before fc (their scales differ by orders of magnitude)
        self.fc_norm = (nn.ModuleList([RMSNorm(H, config.rms_norm_eps) for _ in range(n_feats)])
                        if config.fc_norm else None)
        self.layers = nn.ModuleList([Eagle3Layer(config)])
        self.norm = RMSNorm(H, config.rms_norm_eps)
        self.draft_head = nn.Linear(H, vocab, bias=False)
        self.register_buffer("d2t", torch.arange(vocab), persistent=True)
        self.register_buffer("t2d", torch.zeros(config.vocab_size, dtype=torch.bool), persistent=True)
        self.t2d[self.d2t] = True
        self.embed_tokens = None
        self.lm_head = None
        self.draft_lm_weight = None  # the target's lm_head rows of the draft vocabulary: training targets p

    def set_draft_vocab(self, d2t: torch.Tensor) -> None:
        if d2t.shape != self.d2t.shape:
            raise ValueError(f"draft vocabulary of {d2t.shape[0]} ids does not fit draft_vocab_size="
                             f"{self.d2t.shape[0]}")
        self.d2t.copy_(d2t)
        self.t2d.zero_()
        self.t2d[d2t] = True
        self._gather_draft_rows()

    def _gather_draft_rows(self) -> None:
        if self.lm_head is not None:
            self.draft_lm_weight = draft_rows(self.lm_head.weight, self.d2t).detach()

    def init_from_target_lm_head(self, target) -> None:
        """Start the draft lm_head from the target's rows of the draft vocabulary and the readout norm from the
        target's final norm: the head starts with the target's own readout `lm_head(norm(h))`."""
        with torch.no_grad():
            self.draft_head.weight.copy_(draft_rows(self.lm_head.weight, self.d2t).to(self.draft_head.weight.dtype))
            gain = final_norm_gain(target)
            if gain is not None:
                self.norm.weight.copy_(gain.to(self.norm.weight.dtype))

    def init_identity_fc(self) -> None:
        """fc starts as the mean of the fused features, so the head first sees something like a target hidden."""
        H, n = self.config.hidden_size, len(self.config.feature_layer_ids)
        with torch.no_grad():
            self.fc.weight.copy_(torch.eye(H, dtype=self.fc.weight.dtype).repeat(1, n) / n)

    def init_from_target_layer(self, target, layer: int = -1) -> None:
        raise ValueError("model.init target_last_layer: EAGLE-3's layer reads 2H-wide inputs, no target layer fits")

    def forward(self, features: torch.Tensor, input_ids: torch.Tensor, position_ids: torch.Tensor,
                cache: HeadCache | None = None, mask: torch.Tensor | None = None) -> torch.Tensor:
        """Fused target features (3H) or the head's own hidden states (H), with token t+1 -> hidden h[t]."""
        x = self.fuse(features) if features.shape[-1] != self.config.hidden_size else features
        emb = self.embed(input_ids).to(x.dtype)
        cos, sin = rope_cos_sin(position_ids, self.config.head_dim, self.config.rope_theta, x.dtype)
        for i, layer in enumerate(self.layers):
            x = layer(emb, x, cos, sin, cache, i, mask)
        if cache is not None:
            cache.length += input_ids.shape[1]
        return self.norm(x) if self.config.norm_output else x

    def fuse(self, features: torch.Tensor) -> torch.Tensor:
        """fc over the concatenated target layers [..., n*H] -> [..., H] (each normed first with fc_norm)."""
        if self.fc_norm is not None:
            parts = features.chunk(len(self.fc_norm), dim=-1)
            features = torch.cat([norm(part) for norm, part in zip(self.fc_norm, parts)], dim=-1)
        return self.fc(features)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Draft logits of `forward`'s output (already normed with norm_output, as vLLM's EAGLE-3.1 feeds it on)."""
        return self.draft_head(hidden if self.config.norm_output else self.norm(hidden))

    def to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return self.d2t[draft_ids]


def final_norm_gain(target) -> torch.Tensor | None:
    """The per-dimension gain of the target's final RMS norm, read by normalising a vector of ones (so it is the
    same whether the model stores w or 1 + w, as Gemma does); None when the decoder has no `norm` or it is not an
    RMS norm (a LayerNorm sends ones to its bias)."""
    norm = getattr(target.base, "norm", None)
    if norm is None:
        return None
    p = next(norm.parameters(), None)
    ones = torch.ones(target.hidden_size, device=target.device, dtype=target.dtype if p is None else p.dtype)
    with torch.no_grad():
        gain = norm(ones[None])[0].float()
    eps = float(getattr(norm, "variance_epsilon", getattr(norm, "eps", 0.0)) or 0.0)
    gain = gain * math.sqrt(1.0 + eps)
    return gain if torch.isfinite(gain).all() and gain.abs().max() > 1e-6 else None


def make_head(config: HeadConfig) -> EagleHead:
    """The head class named by `config.head_type`."""
    if config.head_type == "eagle1":
        return EagleHead(config)
    if config.head_type == "eagle3":
        return Eagle3Head(config)
    raise ValueError(f"head_type {config.head_type!r}: expected eagle1 or eagle3")


def load_head(path, device="cpu", dtype=torch.float32, target=None) -> EagleHead:
    """Our checkpoint directory, or one in a published EAGLE-1/2 or EAGLE-3 layout (`eagle.interop`; `target`
    gives an EAGLE-3 head without named feature layers the default ones)."""
    path = Path(path)
    raw = read_raw(path)
    if interop.is_published(raw):
        cfg, state = interop.read_published(path, raw, target)
    else:
        cfg = read_config(path, raw)
        if not (path / "model.safetensors").exists():
            raise CheckpointError(f"draft head {str(path)!r}: no model.safetensors")
        state = read_weights(path)
    head = make_head(cfg)
    problems = validate_state(head, state)
    if problems:
        raise CheckpointError(f"draft head {str(path)!r} does not match its config: " + "; ".join(problems))
    head.load_state_dict(state, strict=False)
    # .to(dtype) leaves the integer d2t buffer alone
    return head.to(device=resolve_device(device), dtype=resolve_dtype(dtype)).eval()


def validate_state(head: EagleHead, state: dict[str, torch.Tensor]) -> list[str]:
    """Every key that is missing, unexpected or of the wrong shape, one line each."""
    want = {k: v.shape for k, v in head.trainable_state_dict().items()}
    problems = [f"missing: {k} {tuple(s)}" for k, s in want.items() if k not in state]
    problems += [f"unexpected: {k} {tuple(v.shape)}" for k, v in state.items() if k not in want]
    problems += [f"wrong shape: {k} {tuple(v.shape)}, expected {tuple(want[k])}"
                 for k, v in state.items() if k in want and v.shape != want[k]]
    return problems


def check_compatible(cfg: HeadConfig, target) -> None:
    """Refuse a head made for another target: hidden size, vocabulary and tokenizer must agree."""
    diffs = []
    if cfg.hidden_size != target.hidden_size:
        diffs.append(f"hidden size {cfg.hidden_size} vs {target.hidden_size}")
    if cfg.vocab_size != target.vocab_size:
        diffs.append(f"vocab size {cfg.vocab_size} vs {target.vocab_size}")
    if cfg.tokenizer_fingerprint and cfg.tokenizer_fingerprint != target.fingerprint:
        diffs.append(f"tokenizer fingerprint {cfg.tokenizer_fingerprint} vs {target.fingerprint}")
    if diffs:
        raise CheckpointError(
            f"draft head for target {cfg.target!r} does not fit target {target.name!r}: " + ", ".join(diffs))
