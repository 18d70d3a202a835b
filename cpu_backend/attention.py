"""Attention of a few query rows in C: `kernels.attend` behind transformers' attention interface.

Up to `MAX_ROWS` float32 query rows on the CPU go to `kernels.attend`, which reads the grouped key/value heads in
place and computes each query row alone, so that a verification pass gives a token the same bits as a one-token
step. Everything else goes to the core's `gqa_sdpa` (eagle.attention). `use(model, True)` switches a model whose
attention is `gqa_sdpa` to this one (`IMPLEMENTATION`; from `sdpa`, under a second name), `use(model, False)` back
to what it was.
"""

from __future__ import annotations

import torch

from cpu_backend import kernels
from eagle.attention import IMPLEMENTATION as GQA_SDPA
from eagle.attention import gqa_sdpa, register

MAX_ROWS = 64  # query rows the C kernel takes (measured: faster than folded sdpa up to 96 rows at 256-1024 keys)
IMPLEMENTATION = "eagle_cpu_sdpa"  # this attention, switched from the core's gqa_sdpa (the decoder's)
# every name this attention is registered under -> the attention a model had before `use` switched it
SWITCHED_FROM = {IMPLEMENTATION: GQA_SDPA, f"{IMPLEMENTATION}_from_sdpa": "sdpa"}


def kernel_fits(query, key, value, attention_mask, dropout, kwargs) -> bool:
    """Whether `kernels.attend` computes this call: a few float32 query rows on the CPU, grouped heads, D a multiple
    of 8, a 4-D mask covering the keys (or one row and no mask), nothing else in play."""
    b, h, m, d = query.shape
    if not (query.device.type == "cpu" and query.dtype == key.dtype == value.dtype == torch.float32
            and m <= MAX_ROWS and d % 8 == 0 and h % key.shape[1] == 0 and not dropout
            and query.stride(-1) == 1 and key.stride(-1) == 1 and key.stride() == value.stride()
            and not kwargs.get("softcap") and kwargs.get("s_aux") is None and kwargs.get("position_bias") is None
            and kernels.available()):
        return False
    if attention_mask is None:
        return m == 1
    return (attention_mask.dim() == 4 and attention_mask.shape[1] == 1 and attention_mask.shape[2] == m
            and attention_mask.shape[0] in (1, b) and attention_mask.shape[-1] >= key.shape[2]
            and attention_mask.dtype in (torch.bool, torch.float32))


def cpu_sdpa(module, query, key, value, attention_mask, dropout=0.0, scaling=None, is_causal=None, **kwargs):
    if kernel_fits(query, key, value, attention_mask, dropout, kwargs):
        mask = None if attention_mask is None else attention_mask[..., :key.shape[2]]
        scale = scaling if scaling is not None else query.shape[-1] ** -0.5
        return kernels.attend(query, key, value, mask, scale), None
    return gqa_sdpa(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, is_causal=is_causal,
                    **kwargs)


def use(model, on: bool) -> bool:
    """Switch a transformers model from `sdpa` or `gqa_sdpa` to this attention (on), or back to the one it had (off;
    eager or flash attention are left alone). Returns whether the model uses this attention now. The name it runs
    under says which it came from (`SWITCHED_FROM`), so a deep copy of the model goes back to the same one."""
    config = model.config
    current = config._attn_implementation
    if on and current in ("sdpa", GQA_SDPA):
        model.set_attn_implementation(next(k for k, v in SWITCHED_FROM.items() if v == current))
    elif not on and current in SWITCHED_FROM:
        model.set_attn_implementation(SWITCHED_FROM[current])
    return config._attn_implementation in SWITCHED_FROM


# registered on import, not on first use: a model pickled whole while the backend was on (its modules pickle as the
# stock ones, its config keeps this attention's name) then loads in any process that imports the backend, and `use`
# can give it back the core's gqa_sdpa there
for _name in SWITCHED_FROM:
    register(_name, cpu_sdpa)
register(GQA_SDPA, gqa_sdpa)
