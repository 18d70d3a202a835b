"""eagle.attention.gqa_sdpa: a tree-masked verification pass without copying the KV cache per query head."""

import torch
from tiny import tiny_head, tiny_target

from eagle.attention import IMPLEMENTATION, use_gqa_sdpa
from infer import SpeculativeDecoder, tree
from infer.cache import TargetCache
from infer.decoder import verify_mask


def _verify_logits(target, prefix, nodes, parents):
    cache = TargetCache()
    L = prefix.shape[1]
    target.features(prefix, position_ids=torch.arange(L)[None], cache=cache.hf)
    node_mask = tree.ancestor_mask(parents)
    depth = tree.depths(parents)
    feats = target.features(nodes, position_ids=L + depth[None], cache=cache.hf,
                            attention_mask=verify_mask(L, node_mask, target.dtype))
    return target.logits(feats[0])


def test_tree_pass_equals_sdpa_and_switches_back():
    target = tiny_target()  # 4 query heads on 2 key/value heads, float64
    assert target.config.num_attention_heads != target.config.num_key_value_heads
    g = torch.Generator().manual_seed(0)
    prefix = torch.randint(0, 96, (1, 11), generator=g)
    nodes = torch.randint(0, 96, (1, 6), generator=g)
    parents = torch.tensor([-1, 0, 0, 1, 1, 3])
    want = _verify_logits(target, prefix, nodes, parents)
    assert use_gqa_sdpa(target.model, True) and target.model.config._attn_implementation == IMPLEMENTATION
    got = _verify_logits(target, prefix, nodes, parents)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    assert not use_gqa_sdpa(target.model, False) and target.model.config._attn_implementation == "sdpa"


def test_eager_attention_is_left_alone():
    target = tiny_target(attn="eager")
    assert not use_gqa_sdpa(target.model, True) and target.model.config._attn_implementation == "eager"


def test_speculative_greedy_equals_plain_greedy_with_gqa_sdpa():
    target = tiny_target()
    dec = SpeculativeDecoder(target, tiny_head(target))
    prompt = [5, 9, 14, 22, 7]
    plain = dec.generate(prompt, max_new_tokens=24, speculative=False, fast_linear=False).token_ids
    assert target.model.config._attn_implementation == "sdpa"
    for mode in ({"num_speculative_tokens": 3}, {"mode": "dynamic", "top_k": 2, "depth": 3, "total_tokens": 6}):
        assert dec.generate(prompt, max_new_tokens=24, **mode).token_ids == plain
        assert target.model.config._attn_implementation == IMPLEMENTATION
