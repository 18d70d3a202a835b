"""eagle.attention.gqa_sdpa: a tree-masked verification pass without copying the KV cache per query head; the CPU
backend's attention in C (cpu_backend.attention)."""

import pytest
import torch
import torch.nn.functional as F
from tiny import tiny_head, tiny_target

from cpu_backend import CPUConfig, kernels
from cpu_backend.attention import SWITCHED_FROM as CPU_ATTENTION
from cpu_backend.fastpath import disable_fast_linear, enable_fast_linear
from cpu_backend.plan import BUCKETS, Plan
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
    plain = dec.generate(prompt, max_new_tokens=24, speculative=False, cpu=CPUConfig(fast_path=False)).token_ids
    assert target.model.config._attn_implementation == "sdpa"
    for mode in ({"num_speculative_tokens": 3}, {"mode": "dynamic", "top_k": 2, "depth": 3, "total_tokens": 6}):
        assert dec.generate(prompt, max_new_tokens=24, **mode).token_ids == plain
        # float64: the core's gqa_sdpa (the CPU backend, and its attention, is for float32)
        assert target.model.config._attn_implementation == IMPLEMENTATION


@pytest.mark.skipif(not kernels.available(), reason="the C kernel does not build here")
@pytest.mark.parametrize("heads,kv_heads,rows,dim,threads", [(6, 3, 5, 16, 2), (9, 3, 5, 64, 2), (9, 3, 5, 64, 1),
                                                          (4, 4, 3, 72, 2), (8, 2, 1, 128, 2)])
def test_kernel_attention_matches_sdpa_and_each_row_alone(heads, kv_heads, rows, dim, threads):
    # query tiles of 1 to 4 vectors (how many depends on the rows and threads), 16-wide value sums (dim >= 64) and
    # 8-wide tails (16, 72), keys in groups of 8 and a tail of 5
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, rows, heads, dim, generator=g).transpose(1, 2)  # [B, H, M, D] as the model makes it
    k = torch.randn(2, kv_heads, 32, dim, generator=g)[:, :, :21]     # a cache buffer's filled part
    v = torch.randn(2, kv_heads, 32, dim, generator=g)[:, :, :21]
    keep = torch.rand(2, 1, rows, 21, generator=g) > 0.3
    keep[..., 0] = True
    rep = heads // kv_heads
    want = F.scaled_dot_product_attention(q, k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1),
                                          attn_mask=keep, scale=dim ** -0.5).transpose(1, 2)
    additive = torch.zeros(2, 1, rows, 21).masked_fill(~keep, float("-inf"))
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for mask in (keep, additive):
            got = kernels.attend(q, k, v, mask, dim ** -0.5)
            torch.testing.assert_close(got, want)
            alone = torch.cat([kernels.attend(q[:, :, i:i + 1], k, v, mask[:, :, i:i + 1], dim ** -0.5)
                               for i in range(rows)], 1)
            assert torch.equal(got, alone)
        dead = keep.clone()
        dead[0, :, 0] = False  # a row that sees no key (padding) gets zeros
        got = kernels.attend(q, k, v, dead, dim ** -0.5)
        assert torch.equal(got[0, 0], torch.zeros(heads, dim))
        assert torch.equal(got[1], kernels.attend(q, k, v, keep, dim ** -0.5)[1])
    finally:
        torch.set_num_threads(before)


@pytest.mark.skipif(not kernels.available(), reason="the C kernel does not build here")
def test_fast_path_verification_pass_gives_each_token_the_bits_of_single_steps():
    # kernel products, norms, MLPs and attention: a verification pass over M <= 64 tokens (here 40) gives every
    # token exactly the logits one-token steps give it, so speculative decoding on the fast path is lossless to the
    # bit
    target = tiny_target(dtype=torch.float32, hidden=64)
    kernel = {f"{m.weight.shape[0]}x{m.weight.shape[1]}": {b: "kernel" for b in BUCKETS}
              for m in target.model.modules() if isinstance(m, torch.nn.Linear)}
    enable_fast_linear(target.model, Plan(layouts=kernel))
    assert target.model.config._attn_implementation in CPU_ATTENTION  # from sdpa, under its second name
    g = torch.Generator().manual_seed(3)
    prefix, nodes = torch.randint(0, 96, (1, 13), generator=g), torch.randint(0, 96, (1, 40), generator=g)
    with torch.no_grad():
        chain = _verify_logits(target, prefix, nodes, torch.arange(40) - 1)
        steps = []
        cache = TargetCache()
        target.features(prefix, position_ids=torch.arange(13)[None], cache=cache.hf)
        for i in range(40):
            feats = target.features(nodes[:, i:i + 1], position_ids=torch.tensor([[13 + i]]), cache=cache.hf)
            steps.append(target.logits(feats[0]))
    assert torch.equal(chain, torch.cat(steps))
    disable_fast_linear(target.model)
    use_gqa_sdpa(target.model, False)
