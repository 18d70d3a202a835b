"""Attention for verification passes with grouped-query attention, without copying the KV cache.

transformers' `sdpa` attention handles a model whose query heads share key/value heads (SmolLM2: 9 query heads
on 3 key/value heads) without copies only when no mask is given: one new token, or a plain causal prefill. A
verification pass brings its own tree mask, and then `repeat_kv` copies every layer's whole cache, keys and values,
once per query head (SmolLM2: 30 layers x 2 x 3 copies of the cache on every pass, growing with the context).

With the C kernel available, up to `MAX_ROWS` float32 query rows on the CPU go to `eagle.cpukernel.attend`, which
reads the grouped key/value heads in place and computes each query row alone, so that a verification pass gives a
token the same bits as a one-token step. Otherwise `gqa_sdpa` keeps the key/value heads as they are and folds the
query heads that share one into the query-length axis instead: [B, H, M, D] -> [B, H_kv, rep * M, D], with the
mask rows repeated to match. Each query row then attends exactly as before. Anything else (no mask, one token, no
GQA, softcapping, attention sinks, position bias) goes to transformers' own `sdpa` function unchanged.

It is registered with transformers' attention interface (the documented extension point) under
`IMPLEMENTATION` and switched on per model instance, reversibly:

    use_gqa_sdpa(target.model, True)    # the model's "sdpa" becomes "eagle_gqa_sdpa"
    use_gqa_sdpa(target.model, False)   # back to "sdpa"
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from eagle import cpukernel

MAX_ROWS = 64  # query rows the C kernel takes (measured: faster than folded sdpa up to 96 rows at 256-1024 keys)

IMPLEMENTATION = "eagle_gqa_sdpa"
_registered = False


def _kernel_fits(query, key, value, attention_mask, dropout, kwargs) -> bool:
    """Whether eagle.cpukernel.attend computes this call: a few float32 query rows on the CPU, grouped heads, D a
    multiple of 8, a 4-D mask covering the keys (or one row and no mask), nothing else in play."""
    b, h, m, d = query.shape
    if not (query.device.type == "cpu" and query.dtype == key.dtype == value.dtype == torch.float32
            and m <= MAX_ROWS and d % 8 == 0 and h % key.shape[1] == 0 and not dropout
            and query.stride(-1) == 1 and key.stride(-1) == 1 and key.stride() == value.stride()
            and not kwargs.get("softcap") and kwargs.get("s_aux") is None and kwargs.get("position_bias") is None
            and cpukernel.available()):
        return False
    if attention_mask is None:
        return m == 1
    return (attention_mask.dim() == 4 and attention_mask.shape[1] == 1 and attention_mask.shape[2] == m
            and attention_mask.shape[0] in (1, b) and attention_mask.shape[-1] >= key.shape[2]
            and attention_mask.dtype in (torch.bool, torch.float32))


def gqa_sdpa(module, query, key, value, attention_mask, dropout=0.0, scaling=None, is_causal=None, **kwargs):
    if _kernel_fits(query, key, value, attention_mask, dropout, kwargs):
        mask = None if attention_mask is None else attention_mask[..., :key.shape[2]]
        scale = scaling if scaling is not None else query.shape[-1] ** -0.5
        return cpukernel.attend(query, key, value, mask, scale), None
    rep = getattr(module, "num_key_value_groups", 1)
    b, h, m, d = query.shape
    plain = (rep == 1 or m == 1 or attention_mask is None or attention_mask.dim() != 4
             or attention_mask.shape[1] != 1 or dropout or kwargs.get("softcap") or kwargs.get("s_aux") is not None
             or kwargs.get("position_bias") is not None or key.shape[1] * rep != h)
    if plain:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      is_causal=is_causal, **kwargs)
    # query head j * rep + r reads key/value head j: its M rows become rows r * M .. r * M + M - 1 of group j
    q = query.reshape(b, h // rep, rep * m, d)
    mask = attention_mask.repeat(1, 1, rep, 1)
    out = F.scaled_dot_product_attention(q, key, value, attn_mask=mask, scale=scaling)
    return out.reshape(b, h, m, d).transpose(1, 2).contiguous(), None


def _register() -> None:
    global _registered
    if not _registered:
        AttentionInterface.register(IMPLEMENTATION, gqa_sdpa)
        AttentionMaskInterface.register(IMPLEMENTATION, sdpa_mask)  # prefill masks are built as for sdpa
        _registered = True


def use_gqa_sdpa(model, on: bool) -> bool:
    """Switch a transformers model between `sdpa` and `gqa_sdpa` (only from `sdpa`: eager or flash attention are
    left alone). Returns whether the model uses `gqa_sdpa` now."""
    current = model.config._attn_implementation
    if on and current == "sdpa":
        _register()
        model.set_attn_implementation(IMPLEMENTATION)
    elif not on and current == IMPLEMENTATION:
        model.set_attn_implementation("sdpa")
    return model.config._attn_implementation == IMPLEMENTATION
