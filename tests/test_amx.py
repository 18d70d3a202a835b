"""Products on AMX tiles (cpu_backend.kernels, where the CPU, the compiler and the OS allow them): Q4_1 codes with
float32 accuracy, and an EAGLE head's weights in bfloat16 while it drafts. Each row keeps its bits at every row
count, so verification passes stay lossless."""

import subprocess
import sys

import pytest
import torch

from paths import kernel_path_missing

from cpu_backend import kernels
from infer import SpeculativeDecoder
from tests.tiny import tiny_head, tiny_target

pytestmark = pytest.mark.skipif(kernel_path_missing("amx") is not None,
                                reason=f"amx path: {kernel_path_missing('amx')}")


def test_amx_products_keep_each_rows_bits_with_float32_accuracy():
    # on AMX tiles the sums run in another order than the float32 path's, so other bits; but every row gets the
    # same bits whatever the row count and its place among the rows, and the error stays that of float32 sums
    g = torch.Generator().manual_seed(3)
    w, b = kernels.q4_1_weight(100, 96, g), torch.randn(100, generator=g)
    gate, up, plain_up = kernels.q4_1_weight(96, 64, g), kernels.q4_1_weight(96, 64, g), torch.randn(96, 64)
    assert kernels.packed(w) & 7 == 2 and kernels.packed(plain_up) & 7 == 0
    x, xg = torch.randn(300, 96, generator=g), torch.randn(300, 64, generator=g)
    exact = x.double() @ w.double().T + b.double()
    silu = torch.nn.functional.silu
    exact_g = silu(xg.double() @ gate.double().T) * (xg.double() @ up.double().T)
    exact_mixed = silu(xg.double() @ gate.double().T) * (xg.double() @ plain_up.double().T)
    whole = [kernels.rows_linear(x, w, b), kernels.rows_gated(xg, gate, up),
             kernels.rows_gated(xg, gate, plain_up)]  # the last: a gate on tiles, an up in float32
    for got, want in zip(whole, (exact, exact_g, exact_mixed)):
        assert ((got.double() - want).abs().max() / want.abs().max()).item() < 2e-6
    for lo, hi in ((0, 1), (7, 8), (0, 3), (5, 21), (16, 33), (40, 297)):  # 1-16 rows a tile, several tiles
        part = [kernels.rows_linear(x[lo:hi], w, b), kernels.rows_gated(xg[lo:hi], gate, up),
                kernels.rows_gated(xg[lo:hi], gate, plain_up)]
        assert all(torch.equal(a, c[lo:hi]) for a, c in zip(part, whole))


def test_bf16_products_keep_each_rows_bits_and_need_the_mark_and_no_gradients(monkeypatch):
    monkeypatch.setattr(kernels, "INT8_DRAFTS", False)  # marked weights in bfloat16 (int8: the next test)
    g = torch.Generator().manual_seed(4)
    w, b = torch.randn(100, 96, generator=g) * 0.05, torch.randn(100, generator=g)
    gate, up = torch.randn(96, 64, generator=g) * 0.1, torch.randn(96, 64, generator=g) * 0.1
    x, xg = torch.randn(300, 96, generator=g), torch.randn(300, 64, generator=g)
    assert kernels.packed(w) & 7 == 0  # not marked: float32
    kernels.draft_precision([w, gate, up])
    assert kernels.packed(w) & 7 == 0  # marked, but gradients are being recorded: float32
    wb, gb, ub = (t.to(torch.bfloat16).double() for t in (w, gate, up))  # the only rounding: the weights'
    exact = x.double() @ wb.T + b.double()
    exact_g = torch.nn.functional.silu(xg.double() @ gb.T) * (xg.double() @ ub.T)
    with torch.no_grad():
        assert kernels.packed(w) & 7 == 3
        whole = [kernels.rows_linear(x, w, b), kernels.rows_gated(xg, gate, up)]
        for got, want in zip(whole, (exact, exact_g)):
            assert ((got.double() - want).abs().max() / want.abs().max()).item() < 2e-6
        for lo, hi in ((0, 1), (7, 8), (5, 21), (40, 297)):
            part = [kernels.rows_linear(x[lo:hi], w, b), kernels.rows_gated(xg[lo:hi], gate, up)]
            assert all(torch.equal(a, c[lo:hi]) for a, c in zip(part, whole))
        kernels.draft_precision([w], on=False)
        assert kernels.packed(w) & 7 == 0


def test_a_heads_own_weights_draft_in_bf16_and_decoding_stays_lossless():
    target = tiny_target(hidden=64, dtype=torch.float32)
    head = tiny_head(target)
    dec = SpeculativeDecoder(target, head)
    prompt = [5, 9, 14, 22, 7]
    greedy = dec.generate(prompt, max_new_tokens=24, speculative=False).token_ids
    assert dec.generate(prompt, max_new_tokens=24, num_speculative_tokens=3).token_ids == greedy
    own = [m.weight for m in head.modules() if isinstance(m, torch.nn.Linear) and m.weight is not target.lm_head.weight]
    assert own and not any(kernels.in_draft_precision(w) for w in own)  # gradients are recorded out here
    with torch.no_grad():
        assert all(kernels.in_draft_precision(w) for w in own)
        assert not any(kernels.in_draft_precision(p) for p in target.model.parameters())
    dec.use_fast_path(False)
    with torch.no_grad():
        assert not any(kernels.in_draft_precision(w) for w in own)


def test_tile_products_survive_other_amx_users_on_the_same_thread():
    # torch's bfloat16 products (oneDNN) use the same tiles and release them: each kernel call must load its own
    # tile configuration again, or its next tile instruction is illegal (the process dies with SIGILL, so the
    # check runs in a child process)
    script = """
import torch
from cpu_backend import kernels
g = torch.Generator().manual_seed(0)
w, lm = kernels.q4_1_weight(256, 576, g), torch.randn(1000, 576, generator=g)
x = torch.randn(6, 576, generator=g)
want, top = kernels.rows_linear(x, w, None), kernels.screen_argmax(x, lm)
a = torch.randn(256, 512).bfloat16()
for _ in range(3):  # the same call again after torch's: its configuration would be taken as still loaded
    torch.mm(a, a.t())
    assert torch.equal(kernels.rows_linear(x, w, None), want)
for _ in range(3):
    torch.mm(a, a.t())
    assert torch.equal(kernels.screen_argmax(x, lm), top)
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, (done.returncode, done.stderr[-2000:])


@pytest.mark.parametrize("layers,draft_vocab", [(1, 0), (2, 64)])
def test_greedy_steps_draft_the_module_paths_bits(monkeypatch, layers, draft_vocab):
    # a greedy chain through cpu_backend.draft.GreedySteps (kept buffers and addresses, three C calls a step) makes
    # the module path's calls on the same numbers: the same drafts and the same head cache, round after round,
    # with several new pairs at once (the causal mask read from a strip) and with a second layer reading the first
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
    assert fast._steps and not modules._steps
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
