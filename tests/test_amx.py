"""Products on AMX tiles (cpu_backend.kernels, where the CPU, the compiler and the OS allow them): Q4_1 codes with
float32 accuracy, and an EAGLE head's weights in bfloat16 while it drafts. Each row keeps its bits at every row
count, so verification passes stay lossless."""

import subprocess
import sys

import pytest
import torch

from paths import force_switches, kernel_path_missing

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
    force_switches(monkeypatch, int8_drafts=False)  # marked weights in bfloat16 (int8: the next test)
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


