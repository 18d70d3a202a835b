"""An EAGLE head's weights in int8 while it drafts (cpu_backend.kernels's `draft_precision`, `pack_i8`): on AMX-INT8
tiles, or with AVX512-VNNI alone in byte products of four rows at a time; each row keeps its bits at every row
count."""

import pytest
import torch

from cpu_backend import kernels
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
    assert kernels.layouts(fc).draft and not fc.__dict__  # marked while drafting, beside the weight
    kernels.draft_precision([fc])
    with torch.no_grad():
        assert kernels.packed(fc) & 7 == 4
    kernels.draft_precision([fc], on=False)
