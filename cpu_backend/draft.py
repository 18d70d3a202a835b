"""An EAGLE head's drafting on the CPU: its layers in C (the backend classes `patch` gives the head and its modules),
and greedy drafting steps that make the same C calls without the modules' Python (`GreedySteps`).

`patch(head)` gives the head's attention modules the class `HeadAttention` (the rotary embedding and the attention in
C: `kernels.rope_`, `kernels.attend`, grouped key / value heads read in place), each EAGLE-1/2 decoder layer
`HeadLayer` (the whole layer in one C call, `kernels.decoder_layer`: the same norms, products, rotary embedding and
attention), and the head `DraftingHead` (its target logits, an EAGLE-1/2 head's draft logits, in the layout of the
target's lm_head, a PackedLinear: `parts.linear_as`); each runs its C only where it fits (inference on the CPU
in float32, a few rows), else the stock class's forward. `unpatch(head)` gives the stock classes back.

A greedy step reads T new (feature, token) pairs into the head's cache and gives the draft screen's argmax after the
last one. Through the modules (`EagleHead.forward` with each decoder layer in one C call, then
`kernels.screen_argmax`) that is three C calls wrapped in ~40 torch and Python operations, and on a 2-core CPU
the wrapping took longer than the calls (a k = 1 drafting round 0.45 ms warm, of which 0.22 in C). `GreedySteps`
makes the same calls on the same numbers, so it drafts the same bits, with its buffers and the weights' kernel
addresses taken once per decoding:

    steps = GreedySteps.build(head)             # None where the module path would not make these calls
    token = steps.step(cache, feats, tokens)    # feats [T, H], tokens [T] -> [1]; the predicted feature: .feature(T)
    steps.read(cache, feats, tokens)            # the pairs read, no token (sampling and trees draft on from there)

The steps read the weights as they were at `build` (the kernel copies behind the addresses are held): build again
for each decoding (`infer.proposer.EagleProposer` does, at `reset`) and after the head's weights or the kernel
settings (`cpu_backend.switches`) change.
"""

from __future__ import annotations

import ctypes

import torch

from cpu_backend import kernels, weight_layouts
from cpu_backend.attention import MAX_ROWS
from cpu_backend.parts import PackedLinear, kernel_rows, linear_as
from cpu_backend.modules import BackendModule
from eagle import head as head_module
from eagle.head import Attention, DecoderLayer, EagleHead

LAYER_IN_ONE_CALL = True  # drafting on the CPU: each decoder layer in one C call (else its parts, attention in C)


def kernel_fits(x: torch.Tensor, head_dim: int) -> bool:
    """Whether a head attention call can take the C kernels: inference on the CPU in float32, a few rows."""
    return (not (torch.is_grad_enabled() and x.requires_grad) and x.is_cpu and x.dtype == torch.float32
            and x.shape[1] <= MAX_ROWS and head_dim % 8 == 0 and head_dim <= 1024 and kernels.available())


class HeadAttention(BackendModule):
    """A head's `Attention` with the rotary embedding and the attention in C."""

    def forward(self, x, cos, sin, cache, layer: int, mask):
        return _attention_forward(self, x, cos, sin, cache, layer, mask)


class HeadLayer(BackendModule):
    """An EAGLE-1/2 head's `DecoderLayer` in one C call where it fits."""

    def forward(self, x, cos, sin, cache, layer: int, mask):
        return _layer_forward(self, x, cos, sin, cache, layer, mask)


class DraftingHead(BackendModule):
    """An EAGLE head whose target logits (its draft logits, EAGLE-1/2) take the layout of the target's lm_head."""

    def target_logits(self, features: torch.Tensor) -> torch.Tensor:
        return self.cap(linear_as(self.lm_head, features, self.draft_lm_weight))


def _attention_forward(self: HeadAttention, x, cos, sin, cache, layer: int, mask):
    """`Attention.forward` with the rotary embedding and the attention in C."""
    if not kernel_fits(x, self.hd):
        return self.stock_forward(x, cos, sin, cache, layer, mask)
    B, T, _ = x.shape
    q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
    q = kernels.rope_(q.contiguous(), cos[:, 0], sin[:, 0], self.hd)  # cos / sin [B, 1, T, D]
    k = kernels.rope_(k.contiguous(), cos[:, 0], sin[:, 0], self.hd)
    q, k, v = (t.view(B, T, -1, self.hd).transpose(1, 2) for t in (q, k, v))
    k, v, mask = self.with_cache(k, v, cache, layer, mask)
    out = kernels.attend(q, k, v, None if mask is None else mask.view(1, 1, *mask.shape[-2:]), self.hd ** -0.5)
    return self.o_proj(out.view(B, T, self.nh * self.hd))


def _layer_forward(self: DecoderLayer, x, cos, sin, cache, layer: int, mask):
    """`DecoderLayer.forward` in one C call (the new keys and values written into the cache's buffers in place)
    where it fits, else through its backend parts."""
    attn, norm1, norm2, mlp = self.self_attn, self.input_layernorm, self.post_attention_layernorm, self.mlp
    dropping = self.training and self.dropout.p  # the C call has no dropout: a training-mode head keeps its own
    if dropping or not (LAYER_IN_ONE_CALL and cache is not None and x.shape[0] == 1 and kernel_fits(x, attn.hd)):
        return self.stock_forward(x, cos, sin, cache, layer, mask)
    T, past = x.shape[1], cache.length
    k_buf, v_buf = cache.buffers(layer, x, (1, attn.nkv), attn.hd, past, past + T)
    if mask is None and T > 1:
        mask = torch.ones(T, past + T, dtype=torch.bool).tril(past)
    if mask is not None:
        mask = mask.reshape(1, 1, *mask.shape[-2:])
        mask = mask if mask.stride(-1) == 1 else mask.contiguous()
    return kernels.decoder_layer(
        x.contiguous(), (None if norm1 is None else norm1.weight, norm1.eps if norm1 else 0.0, norm2.weight,
                         norm2.eps),
        (attn.q_proj.weight, None, attn.k_proj.weight, None, attn.v_proj.weight, None, attn.o_proj.weight, None),
        (mlp.gate_proj.weight, mlp.up_proj.weight, mlp.down_proj.weight), attn.nh, attn.nkv, attn.hd,
        cos[:, 0], sin[:, 0], k_buf, v_buf, past, mask, attn.hd ** -0.5)


def patch(head: EagleHead) -> None:
    """The classes above for `head` and its modules (these objects only)."""
    for mod in list(head.modules()):
        if isinstance(mod, Attention) and not isinstance(mod, BackendModule):
            HeadAttention.from_stock(mod, None)
        elif type(mod) is DecoderLayer:
            HeadLayer.from_stock(mod, None)
    if not isinstance(head, DraftingHead):
        DraftingHead.from_stock(head, None)


def unpatch(head: EagleHead) -> None:
    """The stock classes of the head and its modules again (`fastpath.disable_fast_linear` does the same for every
    backend module, these included)."""
    for mod in list(head.modules()):
        if isinstance(mod, (HeadAttention, HeadLayer, DraftingHead)):
            mod.to_stock()


class GreedySteps:
    max_rows = MAX_ROWS  # pairs a step reads at most (the module path's limit for a layer in one C call)

    def __init__(self, head):
        cfg, first = head.config, head.layers[0].self_attn
        self.head, self.lib = head, kernels.library()
        self.hidden, self.heads, self.kv_heads, self.head_dim = cfg.hidden_size, first.nh, first.nkv, first.hd
        self.rope_key = (cfg.head_dim, cfg.rope_theta, torch.float32, torch.device("cpu"))
        self.fc = (kernels.packed(head.fc.weight), None if head.fc.bias is None else head.fc.bias.data_ptr())
        # per layer, `decoder_layer`'s LayerArgs (the cache buffers set at `_cache_buffers`) and its address
        self.layers = []
        for layer in head.layers:
            attn, mlp, n1, n2 = layer.self_attn, layer.mlp, layer.input_layernorm, layer.post_attention_layernorm
            projs = tuple(t for p in (attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj) for t in (p.weight, p.bias))
            self.layers.append(kernels.layer_args(
                projs, (None if n1 is None else n1.weight, n1.eps if n1 else 0.0, n2.weight, n2.eps),
                (mlp.gate_proj.weight, mlp.up_proj.weight, mlp.down_proj.weight)))
        self.at_layers = [ctypes.addressof(a) for a in self.layers]
        w = self.screen_weight = head.draft_lm_weight
        self.screen = (*kernels.screen_weight_args(kernels.screen_tables(w)), w.data_ptr())
        self.d2t = head.d2t.tolist() if cfg.draft_vocab_size else None
        # the kernels' copies behind those addresses, held so that a copy made again (a weight changed in place,
        # then multiplied through the modules) cannot free one these steps still read
        weights = [head.fc.weight, *(m.weight for m in head.layers.modules() if isinstance(m, torch.nn.Linear)), w]
        self.copies = [dict(weight_layouts.layouts(t).made) for t in weights]
        emb = head.embed_tokens
        # a plain embedding table is read with torch.embedding itself (what its module calls), else the module
        self.table = emb.weight if type(emb) is torch.nn.Embedding and emb.max_norm is None else None
        self.scale, self.vocab = self.head_dim ** -0.5, w.shape[0]
        # the buffers, and their addresses: each torch view or attribute costs microseconds in a drafting round
        H, rows, inter = self.hidden, self.max_rows, max(layer.inter for layer in self.layers)
        self.x = torch.empty(rows, 2 * H)                   # fc's input: embedding rows, then the features
        self.x_rows = [self.x[:t] for t in range(rows + 1)]
        self.y = torch.empty(3, rows, H)                    # fc's output, then the layers' in turn
        self.work = torch.empty(rows * (3 * H + inter + (2 * self.heads + 2 * self.kv_heads) * self.head_dim))
        self.xq = torch.empty(H, dtype=torch.int16)         # the screen's scratch for one row
        self.best = torch.empty(1, dtype=torch.int64)
        self.best_value = ctypes.c_int64.from_address(self.best.data_ptr())
        self.at_x, self.at_y = self.x.data_ptr(), [t.data_ptr() for t in self.y]
        self.at_work, self.at_xq, self.at_best = self.work.data_ptr(), self.xq.data_ptr(), self.best.data_ptr()
        self.threads = 0
        self.rope = (0, 0, 0)  # (positions, cos address, sin address) of the rotary tables
        self.strip = torch.empty(0, dtype=torch.bool)
        # (cache, capacity, per layer (keys, values, head stride) addresses, first key buffer) last seen
        self.kv = (None, 0, [], None)
        self.last = 0  # index in y of the last step's output

    @classmethod
    def build(cls, head) -> GreedySteps | None:
        """Steps for `head` where its module path drafts greedily through these C calls: an EAGLE-1/2 head without
        soft-capping, attached, each layer in one C call (`LAYER_IN_ONE_CALL` and `kernel_fits`), fc
        a PackedLinear in the draft precision (so multiplied in the kernel), the draft screen taking one row; else
        None."""
        if (head.config.head_type != "eagle1" or head.config.logit_softcap or head.embed_tokens is None
                or not LAYER_IN_ONE_CALL or not kernels.available()):
            return None
        w = head.draft_lm_weight
        with torch.inference_mode():  # the draft precision holds only where no gradient is recorded
            fits = (isinstance(head.fc, PackedLinear) and kernels.in_draft_precision(head.fc.weight)
                    and w is not None and w.dtype == torch.float32 and kernels.supports(w)
                    and kernel_rows(head.lm_head, 1) and kernels.screen_tables(w) is not None
                    and all(kernels.supports(m.weight) for m in head.layers.modules()
                            if isinstance(m, torch.nn.Linear))
                    and kernel_fits(torch.empty(1, 1, head.config.hidden_size), head.config.head_dim))
            return cls(head) if fits else None

    def feature(self, rows: int) -> torch.Tensor:
        """The last step's predicted feature after its last pair, [1, H] (overwritten by the next step)."""
        return self.y[self.last, rows - 1: rows]

    def step(self, cache, feats: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """Read pairs (feats [T, H] float32, tokens [T]) into `cache` at its length, as `EagleHead.forward` does,
        and return the greedy draft token after the last one ([1], a target id: the next step's tokens). T <=
        max_rows."""
        T, H, threads = tokens.shape[0], self.hidden, self.read(cache, feats, tokens)
        # 3. the draft screen's argmax of the last row
        V, scores = self.vocab, self.scores.data_ptr()
        left = self.lib.screen_argmax(*self.screen, self.at_y[self.last] + 4 * (T - 1) * H, V, H, 1, scores,
                                      scores + 4 * V, scores + 4 * (V + threads), self.at.data_ptr(), self.at_xq,
                                      self.at_best, threads)
        best = int(kernels.screen_argmax(self.feature(T), self.screen_weight)) if left else self.best_value.value
        return torch.tensor([self.d2t[best] if self.d2t is not None else best])

    def read(self, cache, feats: torch.Tensor, tokens: torch.Tensor) -> int:
        """`step` without its draft token: the pairs read into `cache`, their predicted features in `feature`
        (`EagleHead.forward`'s output, bit for bit). Returns the thread count it ran with."""
        T, H, lib = tokens.shape[0], self.hidden, self.lib
        start = cache.length
        threads = torch.get_num_threads()
        if threads > self.threads:
            self.threads, self.scores = threads, torch.empty(self.vocab + 2 * threads + 3)
            self.at = torch.empty(threads, dtype=torch.int64)
        # 1. fc over the embedding rows and the features
        rows = self.head.embed(tokens) if self.table is None else torch.embedding(self.table, tokens)
        torch.cat((rows, feats), dim=1, out=self.x_rows[T])
        lib.rows_linear(self.fc[0], self.at_x, self.fc[1], self.at_y[0], H, 2 * H, T, threads)
        # 2. the decoder layers: rotary rows start .. start + T - 1, causal over the new pairs
        if start + T > self.rope[0]:
            self._grow_rope(start + T)
        cos, sin = self.rope[1] + 4 * start * self.head_dim, self.rope[2] + 4 * start * self.head_dim
        mask, kind, row_stride = (self._causal(start + T) - start - 1, 1, -1) if T > 1 else (None, 0, 0)
        if cache is not self.kv[0] or start + T > self.kv[1] or (cache.k and cache.k[0] is not self.kv[3]):
            self._cache_buffers(cache, start, start + T)
        src = 0
        for layer in self.at_layers:
            dst = 2 if src == 1 else 1  # y[1] and y[2] in turn
            lib.decoder_layer(self.at_y[src], T, H, layer, self.heads, self.kv_heads, self.head_dim, cos, sin, start,
                              mask, kind, row_stride, self.scale, self.at_work, self.at_y[dst], threads)
            src = dst
        self.last = src
        cache.length = start + T
        return threads

    def _grow_rope(self, positions: int) -> None:
        """The rotary tables (`head.rope_cos_sin`'s rows, [>= positions, head_dim]) grown to `positions`."""
        table = head_module.rope_table(*self.rope_key[:3], "cpu", positions)
        self.rope_tables = table  # held: the addresses below point into them
        self.rope = (table[0].shape[0], table[0].data_ptr(), table[1].data_ptr())

    def _cache_buffers(self, cache, start: int, end: int) -> None:
        """Every layer's key and value buffers in `cache` with room for `end` positions (`HeadCache.buffers`), and
        their addresses."""
        bufs = [cache.buffers(i, self.y, (1, self.kv_heads), self.head_dim, start, end)
                for i in range(len(self.layers))]
        for args, (k, v) in zip(self.layers, bufs):
            args.k_cache, args.v_cache, args.kv_sh = k.data_ptr(), v.data_ptr(), k.stride(1)
        self.kv = (cache, bufs[0][0].shape[2], bufs, bufs[0][0])

    def _causal(self, keys: int) -> int:
        """Address c such that, read from c - start - 1 with a row stride of -1, the strip is the causal mask of
        rows start .. start + T - 1 over keys <= `keys`: its first half is True, its second False, so row m
        (key j visible when j <= start + m) reads the strip at c - start - 1 - m + j, below c exactly then."""
        if self.strip.shape[0] < 2 * keys:
            half = 1 << max(12, (keys - 1).bit_length())
            self.strip = torch.cat([torch.ones(half, dtype=torch.bool), torch.zeros(half, dtype=torch.bool)])
        return self.strip.data_ptr() + self.strip.shape[0] // 2
