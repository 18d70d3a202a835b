"""An EAGLE head's weights in int8 while it drafts (cpu_backend.kernels's `draft_precision`, `pack_i8`): on AMX-INT8
tiles, or with AVX512-VNNI alone in byte products of four rows at a time; each row keeps its bits at every row
count."""

import pytest
import torch

from cpu_backend import kernels, weight_layouts
from infer import SpeculativeDecoder
from tests.tiny import tiny_head, tiny_target

pytestmark = pytest.mark.skipif(not (kernels.available() and kernels.library().int8_products()),
                                reason="no AMX-INT8 or AVX512-VNNI here")


def test_int8_draft_products_are_the_rounded_weights_and_inputs_exactly_and_keep_each_rows_bits():
    # marked weights (a head's while drafting) in int8 with a scale per output; each input row rounded to int16 with
    # its own scale; integer sums exact, so the result is the float64 product of the two roundings to float32's
    # accuracy, and a row gets the same bits at any row count
    g = torch.Generator().manual_seed(6)
    w, b = torch.randn(100, 96, generator=g) * 0.05, torch.randn(100, generator=g)
    gate, up = torch.randn(96, 64, generator=g) * 0.1, torch.randn(96, 64, generator=g) * 0.1
    x, xg = torch.randn(40, 96, generator=g), torch.randn(40, 64, generator=g)
    x[3] = 0.0  # a zero row

    def rounded(t):  # as pack_i8 rounds a weight
        s = t.abs().amax(1) / 127
        return (torch.round(t / s[:, None]).clamp(-127, 127) * s[:, None]).double()

    def rounded_rows(t):  # as the kernel rounds input rows: int16 with the largest |x| at kq
        kq = min(16383, (2 ** 31 - 1) // 127 // (-(-t.shape[1] // 64) * 64))
        sx = t.abs().amax(1) / kq
        sx = torch.where(sx > 0, sx, torch.ones_like(sx))
        return (torch.round(t / sx[:, None]).clamp(-kq, kq) * sx[:, None]).double()

    exact = rounded_rows(x) @ rounded(w).T + b.double()
    silu = torch.nn.functional.silu
    exact_g = silu(rounded_rows(xg) @ rounded(gate).T) * (rounded_rows(xg) @ rounded(up).T)
    kernels.draft_precision([w, gate, up])
    with torch.no_grad():
        assert kernels.packed(w) & 7 == 4
        whole = [kernels.rows_linear(x, w, b), kernels.rows_gated(xg, gate, up)]
        for got, want in zip(whole, (exact, exact_g)):
            assert ((got.double() - want).abs().max() / want.abs().max()).item() < 2e-6
        for lo, hi in ((0, 1), (7, 8), (0, 3), (4, 8), (5, 21), (3, 40)):  # byte products up to 4 rows, then tiles
            part = [kernels.rows_linear(x[lo:hi], w, b), kernels.rows_gated(xg[lo:hi], gate, up)]
            assert all(torch.equal(a, c[lo:hi]) for a, c in zip(part, whole))
    kernels.draft_precision([w, gate, up], on=False)


def test_a_head_drafting_in_int8_keeps_speculative_decoding_lossless():
    target = tiny_target(dtype=torch.float32)
    dec = SpeculativeDecoder(target, tiny_head(target))
    prompt = [5, 9, 14, 22, 7]
    greedy = dec.generate(prompt, max_new_tokens=24, speculative=False).token_ids
    for k in (1, 3):
        assert dec.generate(prompt, max_new_tokens=24, num_speculative_tokens=k).token_ids == greedy
    fc = dec.head.fc.weight
    assert weight_layouts.layouts(fc).draft and not fc.__dict__  # marked while drafting, beside the weight
    kernels.draft_precision([fc])
    with torch.no_grad():
        assert kernels.packed(fc) & 7 == 4
    kernels.draft_precision([fc], on=False)


@pytest.mark.parametrize("layers,draft_vocab", [(1, 0), (2, 64)])
def test_greedy_steps_draft_the_module_paths_bits(monkeypatch, layers, draft_vocab):
    # a greedy chain through cpu_backend.draft.GreedySteps (kept buffers and addresses, three C calls a step) makes
    # the module path's calls on the same numbers: the same drafts and the same head cache, round after round,
    # with several new pairs at once (the causal mask read from a strip) and with a second layer reading the first
    from cpu_backend.draft import GreedySteps
    from eagle.head import EagleHead, HeadConfig
    from infer.decoder import DecodeConfig
    from infer.proposer import EagleProposer

    target = tiny_target(hidden=64, dtype=torch.float32)
    torch.manual_seed(1)
    head = EagleHead(HeadConfig.for_target(target, num_layers=layers, draft_vocab_size=draft_vocab)).attach(target)
    if draft_vocab:
        head.set_draft_vocab(torch.arange(1, 1 + draft_vocab))
    dec = SpeculativeDecoder(target, head)
    dec.use_fast_path(True)
    lm = target.lm_head  # the draft screen, as for SmolLM2's lm_head (this tiny one's plan prefers torch)
    monkeypatch.setattr(lm.cpu_plan, "by_rows", ["kernel"] * len(lm.cpu_plan.by_rows))
    fast, modules = EagleProposer(head), EagleProposer(head)
    modules._steps = False  # no steps: the module path
    fast.screen = modules.screen = True  # greedy drafts through the draft screen, as decoding with the backend has them
    calls = {"step": 0}
    step = GreedySteps.step
    monkeypatch.setattr(GreedySteps, "step", lambda *a: calls.update(step=calls["step"] + 1) or step(*a))
    g = torch.Generator().manual_seed(0)
    feats, ids = torch.randn(1, 40, 64, generator=g), torch.randint(0, 96, (1, 40), generator=g)
    cfg = DecodeConfig(mode="chain", num_speculative_tokens=3)
    # other modes read the new pairs through the steps too (`GreedySteps.read`), then draft through the modules
    others = [DecodeConfig(mode="dynamic", top_k=2, depth=2, total_tokens=4),
              DecodeConfig(mode="chain", num_speculative_tokens=2, temperature=0.8)]
    at = 0
    for new in (9, 1, 3, 2, 1, 4):  # pairs committed this round, as the decoder hands them over
        drafts = [p.propose(feats[:, at:at + new], ids[:, at:at + new], cfg) for p in (fast, modules)]
        assert torch.equal(drafts[0].tokens, drafts[1].tokens) and torch.equal(drafts[0].parents, drafts[1].parents)
        assert fast.cache.length == modules.cache.length == at + new + 2
        for a, b in zip(fast.cache.k + fast.cache.v, modules.cache.k + modules.cache.v):
            assert torch.equal(a[:, :, :at + new + 2], b[:, :, :at + new + 2])
        for other in others:
            fast.rollback(at), modules.rollback(at)
            more = [p.propose(feats[:, at:at + new], ids[:, at:at + new], other, torch.Generator().manual_seed(at))
                    for p in (fast, modules)]
            assert torch.equal(more[0].tokens, more[1].tokens) and torch.equal(more[0].parents, more[1].parents)
            assert (more[0].q is None) == (more[1].q is None) and (more[0].q is None or torch.equal(more[0].q,
                                                                                                    more[1].q))
        at += new
        fast.rollback(at), modules.rollback(at)
    assert fast._steps and not modules._steps and calls["step"] > 0
    if draft_vocab:
        assert all(1 <= t <= draft_vocab for t in drafts[0].tokens[1:].tolist())
    if layers == 1:  # past 4,096 positions: the rotary table and the mask strip grow
        long_feats, long_ids = torch.randn(1, 4200, 64, generator=g), torch.randint(0, 96, (1, 4200), generator=g)
        for p in (fast, modules):
            p.rollback(at)
            p.propose(long_feats, long_ids, cfg)  # more pairs than a step takes: the module path for both
            p.rollback(at + 4200)
        drafts = [p.propose(feats[:, :3], ids[:, :3], cfg) for p in (fast, modules)]
        assert torch.equal(drafts[0].tokens, drafts[1].tokens) and fast.cache.length == modules.cache.length
        for a, b in zip(fast.cache.k + fast.cache.v, modules.cache.k + modules.cache.v):
            assert torch.equal(a[:, :, :fast.cache.length], b[:, :, :fast.cache.length])
    dec.use_fast_path(False)
