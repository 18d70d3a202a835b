"""Attention for verification passes with grouped-query attention, without copying the KV cache.

transformers' `sdpa` attention handles a model whose query heads share key/value heads (SmolLM2: 9 query heads
on 3 key/value heads) without copies only when no mask is given: one new token, or a plain causal prefill. A
verification pass brings its own tree mask, and then `repeat_kv` copies every layer's whole cache, keys and values,
once per query head (SmolLM2: 30 layers x 2 x 3 copies of the cache on every pass, growing with the context).

`gqa_sdpa` keeps the key/value heads as they are and folds the query heads that share one into the query-length
axis instead: [B, H, M, D] -> [B, H_kv, rep * M, D], with the mask rows repeated to match. Each query row then
attends exactly as before. Anything else (no mask, one token, no GQA, softcapping, attention sinks, position bias)
goes to transformers' own `sdpa` function unchanged. Plain torch: it runs on any device.

It is registered with transformers' attention interface (the documented extension point) under
`IMPLEMENTATION` and switched on per model instance, reversibly:

    use_gqa_sdpa(target.model, True)    # the model's "sdpa" becomes "eagle_gqa_sdpa"
    use_gqa_sdpa(target.model, False)   # back to "sdpa"
"""

from __future__ import annotations

import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

IMPLEMENTATION = "eagle_gqa_sdpa"
_registered = False


def gqa_sdpa(module, query, key, value, attention_mask, dropout=0.0, scaling=None, is_causal=None, **kwargs):
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


def register(name: str, function) -> None:
    """An attention function under `name` in transformers' interface, its masks built as for `sdpa`."""
    AttentionInterface.register(name, function)
    AttentionMaskInterface.register(name, sdpa_mask)


def use_gqa_sdpa(model, on: bool) -> bool:
    """Switch a transformers model between `sdpa` and `gqa_sdpa` (only from `sdpa`: eager or flash attention are
    left alone). Returns whether the model uses `gqa_sdpa` now."""
    global _registered
    current = model.config._attn_implementation
    if on and current == "sdpa":
        if not _registered:
            register(IMPLEMENTATION, gqa_sdpa)
            _registered = True
        model.set_attn_implementation(IMPLEMENTATION)
    elif not on and current == IMPLEMENTATION:
        model.set_attn_implementation("sdpa")
    return model.config._attn_implementation == IMPLEMENTATION
