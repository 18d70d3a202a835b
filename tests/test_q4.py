"""Weights dequantized from GGUF Q4_1 or Q8_0 are read in that form (cpu_backend.kernels.packed) and keep every bit."""

import pytest
import torch

from paths import force_switches
from cpu_backend import kernels
from infer import SpeculativeDecoder
from tests.tiny import tiny_head, tiny_target

pytestmark = pytest.mark.skipif(not (kernels.available() and kernels.library().q4_supported()),
                                reason="the C kernel does not build here or has no Q4_1 path (AVX2 or AVX-512)")


def test_q4_1_form_is_found_and_decodes_to_the_weight_bit_for_bit():
    g = torch.Generator().manual_seed(0)
    w = kernels.q4_1_weight(100, 96, g)
    q, d, m = kernels.q4_1_codes(w)
    assert q.dtype == torch.uint8 and int(q.max()) <= 15 and d.shape == m.shape == (100, 3)
    back = d.repeat_interleave(32, 1) * q.float() + m.repeat_interleave(32, 1)
    assert torch.equal(back.view(torch.int32), w.view(torch.int32))
    assert kernels.pack_q4(q, d, m).shape == (4, 3, 640)  # 100 outputs: three blocks of 32 and a padded one
    assert kernels.q4_1_codes(torch.randn(64, 64, generator=g)) is None  # an ordinary float32 weight
    nudged = w.clone()
    nudged[7, 40] = torch.nextafter(nudged[7, 40], torch.tensor(1.0))  # one value off the grid by one ulp
    assert kernels.q4_1_codes(nudged) is None
    assert kernels.q4_1_codes(torch.zeros(32, 64)) is not None  # groups of one value (d = 0)


def test_q4_products_give_the_float32_products_bits(monkeypatch):
    # the FMA path: the same float32 weights and the same sums in the same order, so the same bits, for every row
    # count
    force_switches(monkeypatch, amx=False)
    _codes_give_the_float32_bits(monkeypatch, kernels.q4_1_weight, 1, tag=1)


def _codes_give_the_float32_bits(monkeypatch, make, seed: int, tag: int, in_f: int = 64) -> None:
    """Products and gated products of weights from `make` read as codes (`packed` tagged `tag`) against their float32
    copies, at every row count: one tile; several, each group decoded once; passes of 96. (The FMA path: VNNI byte
    products give other bits.)"""
    force_switches(monkeypatch, vnni=False)
    g = torch.Generator().manual_seed(seed)
    w, b = make(100, in_f, g), torch.randn(100, generator=g)
    gate, up = make(96, in_f, g), make(96, in_f, g)
    x = torch.randn(130, in_f, generator=g)
    for rows in (1, 2, 3, 4, 8, 12, 13, 17, 30, 130):
        out = []
        for codes in (True, False):
            force_switches(monkeypatch, q4_1=codes)
            assert kernels.packed(w) & 7 == (tag if codes else 0)  # the codes, or the float32 copy
            out.append((kernels.rows_linear(x[:rows], w, b), kernels.rows_gated(x[:rows], gate, up)))
        assert all(torch.equal(a, c) for a, c in zip(*out))


def _q5_0_weight(out_f: int, in_f: int, generator: torch.Generator, top: int = 16) -> torch.Tensor:
    # a GGUF Q5_0 (top 16) or Q4_0 (top 8) weight dequantized as transformers does: d (q - top) in float32, with d =
    # max / -top in float16 (either sign), so each group's largest magnitude has the code -top
    d = ((torch.rand(out_f, in_f // 32, 1, generator=generator) - 0.5) * 0.04).half().float()
    q = torch.randint(-top, top, (out_f, in_f // 32, 32), generator=generator)
    q[..., 5] = -top
    return (d * q.float()).reshape(out_f, in_f)


def test_q5_0_and_q4_0_forms_are_read_as_int8_codes_with_the_float32_bits(monkeypatch):
    # Gemma-3's GGUF stores most projections as Q5_0: d (q - 16), the Q8_0 form with fewer bits a code
    g = torch.Generator().manual_seed(5)
    for top in (16, 8):
        w = _q5_0_weight(96, 128, g, top)
        q, d = kernels.q8_0_codes(w)
        assert int(q.abs().max()) <= 16  # (a Q4_0 group may come back as d / 2 and twice its codes: as exact)
        assert torch.equal(d.repeat_interleave(32, 1) * q.float(), w)  # -0.0 (d < 0, code 0) read as 0.0
    mixed = torch.cat([_q5_0_weight(32, 64, g), kernels.q8_0_weight(32, 64, g)])  # groups of both in one weight
    assert kernels.q8_0_codes(mixed) is not None and kernels.q4_1_codes(mixed) is None
    _codes_give_the_float32_bits(monkeypatch, _q5_0_weight, 6, tag=5)


def test_decoding_a_q4_1_target_is_the_same_with_and_without_the_codes(monkeypatch):
    target = tiny_target(hidden=64, dtype=torch.float32)
    g = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for mod in target.model.model.layers.modules():
            if isinstance(mod, torch.nn.Linear):
                mod.weight.copy_(kernels.q4_1_weight(*mod.weight.shape, g))
    dec = SpeculativeDecoder(target, tiny_head(target))
    prompt = [5, 9, 14, 22, 7]
    runs = []
    force_switches(monkeypatch, amx=False)  # the FMA path keeps the float32 weights' bits
    force_switches(monkeypatch, vnni=False)
    for on in (True, False):
        force_switches(monkeypatch, q4_1=on)
        runs += [dec.generate(prompt, max_new_tokens=24, speculative=False).token_ids,
                 dec.generate(prompt, max_new_tokens=24, num_speculative_tokens=3).token_ids]
        layer = target.model.model.layers[0].mlp.gate_proj.weight
        assert bool(kernels.packed(layer) & 1) == on
    assert all(r == runs[0] for r in runs)
    force_switches(monkeypatch, q4_1=True)
    force_switches(monkeypatch, amx=True)
    force_switches(monkeypatch, vnni=True)
    tag = 2 if kernels.amx_on() else 9 if kernels.library().vq_supported() else 0
    if tag:  # on AMX tiles or VNNI byte products: other bits, and speculative decoding still gives greedy's tokens
        greedy = dec.generate(prompt, max_new_tokens=24, speculative=False).token_ids
        assert kernels.packed(layer) & 15 == tag
        for k in (1, 3, 6):
            assert dec.generate(prompt, max_new_tokens=24, num_speculative_tokens=k).token_ids == greedy


def test_q8_0_form_is_found_and_its_products_give_the_float32_bits(monkeypatch):
    # a GGUF Q8_0 weight (SmolLM2's lm_head) is read as int8 codes and float16 scales on the FMA path, with AMX on
    # too: the same float32 values and sums, so the float32 layout's bits, for every row count
    g = torch.Generator().manual_seed(3)
    w = kernels.q8_0_weight(100, 64, g)
    q, d = kernels.q8_0_codes(w)
    assert q.dtype == torch.int8 and d.shape == (100, 2)
    assert torch.equal((d.repeat_interleave(32, 1) * q.float()).view(torch.int32), w.view(torch.int32))
    assert kernels.pack_q8(q, d).shape == (4, 2, 1088)
    assert kernels.q8_0_codes(torch.randn(64, 64, generator=g)) is None
    nudged = w.clone()
    nudged[50, 9] = torch.nextafter(nudged[50, 9], torch.tensor(1.0))
    assert kernels.q8_0_codes(nudged) is None and kernels.q8_0_codes(torch.zeros(32, 64)) is not None
    _codes_give_the_float32_bits(monkeypatch, kernels.q8_0_weight, 4, tag=5)


VNNI = pytest.mark.skipif(not (kernels.available() and kernels.library().vq_supported()),
                          reason="no AVX512-VNNI and VBMI here")


@VNNI
@pytest.mark.parametrize("make", [kernels.q4_1_weight, kernels.q8_0_weight, _q5_0_weight])
def test_vnni_byte_products_keep_each_rows_bits_with_float32_accuracy(monkeypatch, make):
    _byte_products_keep_each_rows_bits(monkeypatch, make, 96, 64)


def _byte_products_keep_each_rows_bits(monkeypatch, make, in_f: int, in_g: int) -> None:
    """Without AMX tiles, codes go to byte products (bit 3 of the address set): other bits than the FMA path's, the
    error of float32 sums or less, and every row the same bits whatever the row count and its place among the rows
    (up to 64 rows, in tiles of 3). Weights from `make`: [100, in_f]; a gate and an up [96, in_g]."""
    force_switches(monkeypatch, amx=False)
    force_switches(monkeypatch, vnni=True)
    g = torch.Generator().manual_seed(7)
    w, b = make(100, in_f, g), torch.randn(100, generator=g)
    gate, up, plain_up = make(96, in_g, g), make(96, in_g, g), torch.randn(96, in_g)
    assert kernels.packed(w) & 15 in (9, 13, 14) and kernels.packed(plain_up) & 15 == 0
    x, xg = torch.randn(64, in_f, generator=g) * 3, torch.randn(64, in_g, generator=g)
    x[5, :32] *= 1e-6  # a group of tiny values, and one of zeros: their own scales
    x[9, 32:64] = 0.0
    # tiny negatives beside ordinary values (GELU's and SiLU's far left): x / s + 1 rounds to 1 in float32, which
    # the split once took for a whole -s (Gemma-3's down projection was off by 1e-2 after a GELU of -1e-20)
    x[11, 3], x[12, 40], xg[13, 5] = -1e-20, -3e-9, -1e-25
    exact = x.double() @ w.double().T + b.double()
    silu = torch.nn.functional.silu
    exact_g = silu(xg.double() @ gate.double().T) * (xg.double() @ up.double().T)
    exact_mixed = silu(xg.double() @ gate.double().T) * (xg.double() @ plain_up.double().T)
    whole = [kernels.rows_linear(x, w, b), kernels.rows_gated(xg, gate, up),
             kernels.rows_gated(xg, gate, plain_up)]  # the last: a gate in codes, an up in float32 (the FMA path)
    for got, want in zip(whole, (exact, exact_g, exact_mixed)):
        assert ((got.double() - want).abs().max() / want.abs().max()).item() < 2e-6
    for r in (5, 11, 12):
        assert ((whole[0][r].double() - exact[r]).abs().max() / exact[r].abs().max()).item() < 2e-6
    gelu = kernels.rows_gated(xg, gate, up, kernels.GELU_TANH)  # Gemma's activation, as g sigmoid(2 z)
    exact_gelu = (torch.nn.functional.gelu(xg.double() @ gate.double().T, approximate="tanh")
                  * (xg.double() @ up.double().T))
    assert ((gelu.double() - exact_gelu).abs().max() / exact_gelu.abs().max()).item() < 2e-6
    for lo, hi in ((0, 1), (7, 8), (0, 2), (4, 7), (5, 21), (1, 64)):
        part = [kernels.rows_linear(x[lo:hi], w, b), kernels.rows_gated(xg[lo:hi], gate, up)]
        assert all(torch.equal(a, c[lo:hi]) for a, c in zip(part, whole))
    force_switches(monkeypatch, vnni=False)
    fma = kernels.rows_linear(x, w, b)
    assert not torch.equal(fma, whole[0])  # other bits indeed
    bad = x[:3].clone()
    bad[1, 7] = float("nan")  # a row with a NaN: the call takes the FMA path, which carries it
    force_switches(monkeypatch, vnni=True)
    got = kernels.rows_linear(bad, w, b)
    assert torch.isnan(got[1]).all() and torch.equal(got[[0, 2]], fma[[0, 2]])
