"""K-quant codes (GGUF Q4_K, Q5_K, Q6_K) read from the file: decoded exactly as gguf-py (transformers' loader)
dequantizes them, matched to a model's weights by their rows, and multiplied by the kernels with the float32 bits
(the FMA path) or by byte products."""

import numpy as np
import pytest
import torch
from paths import force_switches
from gguf import GGMLQuantizationType, GGUFReader, GGUFWriter
from gguf.quants import dequantize
from test_q4 import VNNI, _byte_products_keep_each_rows_bits, _codes_give_the_float32_bits
from tiny import tiny_target

from cpu_backend import gguf_codes, kernels, weight_layouts

KINDS = ["Q4_K", "Q5_K", "Q6_K"]


def _random_blocks(kind: str, n: int, rng: np.random.Generator) -> np.ndarray:
    """n super-blocks of random bytes whose float16 d (and dmin) are small finite values, as a quantizer writes."""
    raw = rng.integers(0, 256, size=(n, gguf_codes.BLOCK_BYTES[kind]), dtype=np.uint8)
    halves = (rng.random((n, 2)) * 0.01).astype(np.float16).view(np.uint8)
    if kind == "Q6_K":
        raw[:, 208:210] = halves[:, :2]
    else:
        raw[:, 0:4] = halves
    return raw


@pytest.mark.parametrize("kind", KINDS)
def test_k_quant_blocks_decode_as_gguf_dequantizes_them(kind):
    raw = _random_blocks(kind, 64, np.random.default_rng(0))
    q, d, m = gguf_codes.decode_blocks(raw, kind)
    assert q.dtype == np.int8 and d.shape == m.shape == (64, 16)
    want = torch.from_numpy(dequantize(raw.reshape(-1), GGMLQuantizationType[kind]).reshape(64, 256))
    got = gguf_codes.decode(torch.from_numpy(q), torch.from_numpy(d), torch.from_numpy(m))
    assert torch.equal(got, want)  # the same values (a zero's sign aside), so the same products


def _kquant_weight(out_f: int, in_f: int, generator: torch.Generator, kind: str = "Q4_K") -> torch.Tensor:
    # a weight as transformers loads a K-quant tensor, with the codes `gguf_codes.attach` would give it
    seed = int(torch.randint(0, 1 << 30, (1,), generator=generator))
    raw = _random_blocks(kind, out_f * in_f // 256, np.random.default_rng(seed))
    q, d, m = (torch.from_numpy(a) for a in gguf_codes.decode_blocks(raw, kind))
    q, d, m = q.reshape(out_f, in_f), d.reshape(out_f, in_f // 16), m.reshape(out_f, in_f // 16)
    w = torch.from_numpy(dequantize(raw.reshape(-1), GGMLQuantizationType[kind]).reshape(out_f, in_f)).clone()
    weight_layouts.layouts(w).kquant = (q, d, m)
    return w


@pytest.mark.parametrize("kind", KINDS)
def test_k_quant_codes_give_the_float32_bits(monkeypatch, kind):
    _codes_give_the_float32_bits(monkeypatch, lambda o, i, g: _kquant_weight(o, i, g, kind), 7, tag=6, in_f=256)


@VNNI
@pytest.mark.parametrize("kind", KINDS)
def test_k_quant_codes_on_byte_products_keep_each_rows_bits(monkeypatch, kind):
    # a d and an m per 16 inputs: each half of a group of 32 scaled on its own
    _byte_products_keep_each_rows_bits(monkeypatch, lambda o, i, g: _kquant_weight(o, i, g, kind), 256, 256)


def test_codes_that_no_longer_decode_to_the_weight_are_not_used():
    w = _kquant_weight(32, 256, torch.Generator().manual_seed(1))
    assert kernels.kquant_codes(w) is not None
    w[3, 7] += 1.0
    assert kernels.kquant_codes(w) is None


def test_codes_are_matched_to_weights_by_rows_through_a_gguf_file(tmp_path):
    # a file holding one Q4_K and one Q6_K tensor: a weight equal to a tensor with its rows reordered (as
    # transformers reorders Llama's q / k rows) gets the tensor's codes in its own row order; others get none
    rng = np.random.default_rng(3)
    blocks = {k: _random_blocks(k, 64, rng) for k in ("Q4_K", "Q6_K")}
    writer = GGUFWriter(tmp_path / "t.gguf", "llama")
    for kind, raw in blocks.items():
        writer.add_tensor(f"{kind}.weight", raw, raw_dtype=GGMLQuantizationType[kind])  # 64 rows of 256 values
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    listed = [(t.name, tuple(int(x) for x in t.shape), int(t.tensor_type), int(t.data_offset))
              for t in GGUFReader(tmp_path / "t.gguf").tensors]
    assert gguf_codes._tensors(tmp_path / "t.gguf") == listed  # the header read as gguf-py reads it
    model = torch.nn.Module()
    perm = torch.randperm(64, generator=torch.Generator().manual_seed(0))
    values = {k: torch.from_numpy(dequantize(r.reshape(-1), GGMLQuantizationType[k]).reshape(64, 256))
              for k, r in blocks.items()}
    model.a = torch.nn.Parameter(values["Q4_K"][perm].clone(), requires_grad=False)
    model.b = torch.nn.Parameter(values["Q6_K"].clone(), requires_grad=False)
    model.c = torch.nn.Parameter(torch.randn(64, 256), requires_grad=False)
    assert gguf_codes.attach(model, tmp_path / "t.gguf") == 2
    for p in (model.a, model.b):
        q, d, m = kernels.kquant_codes(p)
        assert torch.equal(gguf_codes.decode(q, d, m), p)
    assert weight_layouts.layouts(model.c).kquant is None and not model.c.__dict__


def test_a_target_with_k_quant_weights_decodes_the_same_with_and_without_the_codes(monkeypatch, kernel_path):
    # every CPU path: on the float32 ones (AMX tiles take Q4_1 codes only) the codes give the float32 weights'
    # bits; byte products give other bits, and speculation still gives greedy's tokens
    from infer import SpeculativeDecoder
    from tiny import tiny_head

    target = tiny_target(hidden=256, dtype=torch.float32)
    g = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for mod in target.model.model.layers.modules():
            if isinstance(mod, torch.nn.Linear) and mod.weight.shape[1] % 256 == 0:
                w = _kquant_weight(*mod.weight.shape, g, "Q6_K" if mod.weight.shape[0] % 64 else "Q4_K")
                mod.weight.copy_(w)
                weight_layouts.layouts(mod.weight).kquant = weight_layouts.layouts(w).kquant
    dec = SpeculativeDecoder(target, tiny_head(target))
    prompt, layer = [5, 9, 14, 22, 7], target.model.model.layers[0].self_attn.q_proj.weight
    if kernel_path == "vnni":
        greedy = dec.generate(prompt, max_new_tokens=16, speculative=False).token_ids
        assert kernels.packed(layer) & 15 == 14
        assert dec.generate(prompt, max_new_tokens=16, num_speculative_tokens=3).token_ids == greedy
        return
    runs = []
    for on in (True, False):
        force_switches(monkeypatch, q4_1=on)
        runs += [dec.generate(prompt, max_new_tokens=16, speculative=False).token_ids,
                 dec.generate(prompt, max_new_tokens=16, num_speculative_tokens=3).token_ids]
        assert kernels.packed(layer) & 7 == (6 if on else 0)
    assert all(r == runs[0] for r in runs)


def test_a_gguf_target_runs_when_its_codes_cannot_be_read(monkeypatch):
    # the codes only save time: the backend enables a target whose file they cannot be read from, with a warning
    import cpu_backend
    from eagle import load_target

    def broken(model, path):
        raise ValueError("unreadable")

    t = load_target("smollm2-135m")
    assert t.source is not None and t.source.suffix == ".gguf"
    monkeypatch.setattr(gguf_codes, "attach", broken)
    with pytest.warns(UserWarning, match="K-quant codes not read .ValueError: unreadable"):
        cpu_backend.enable(t.model, plan=cpu_backend.plan.Plan(), gguf=t.source)
    cpu_backend.disable(t.model)
    assert t.vocab_size == 49152
