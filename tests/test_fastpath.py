"""The measured matmul layouts (cpu_backend.fastpath) compute what F.linear computes, and come off cleanly."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from cpu_backend import fastpath, kernels, parts, plan
from cpu_backend.fastpath import calibrate, disable_fast_linear, enable_fast_linear, fast_linear_enabled
from cpu_backend.fused import FusedLayer, FusedStack, KernelAttention
from cpu_backend.parts import PackedLinear, plan_training
from cpu_backend.plan import BUCKETS, LAYOUTS, Plan, linear
from cpu_backend.modules import BackendModule
from eagle.attention import use_gqa_sdpa
from cpu_backend import CPUConfig
from infer import SpeculativeDecoder
from infer.cache import TargetCache
from paths import force_switches, kernel_path_missing
from tests.tiny import tiny_head, tiny_target


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("shape", [(576, 576), (192, 576), (1536, 576), (576, 1536), (4096, 576), (7, 5)])
def test_layouts_match_f_linear(layout, shape):
    g = torch.Generator().manual_seed(0)
    w = torch.randn(*shape, generator=g)
    b = torch.randn(shape[0], generator=g)
    for rows in sorted(set(BUCKETS) | {3, 5, 9, 17, 33, 100, 600}):  # 600: the kernel takes long inputs in chunks
        x = torch.randn(1, rows, shape[1], generator=g)
        for bias in (None, b):
            got = linear(x, w, bias, layout)
            want = F.linear(x, w, bias)
            assert got.shape == want.shape and got.is_contiguous()
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4 * shape[1] ** 0.5)


@pytest.mark.skipif(not kernels.available(), reason="the C kernel does not build here")
def test_kernel_gives_every_row_the_same_bits_whatever_the_row_count():
    # what makes a verification pass give each token exactly the logits of a single-token step
    # 100 outputs: three packed blocks of 32 and a partial one; up to 30 rows: tiles of 12, halves, single rows
    g = torch.Generator().manual_seed(1)
    w, b = torch.randn(100, 64, generator=g), torch.randn(100, generator=g)
    x = torch.randn(30, 64, generator=g)
    alone = torch.cat([kernels.rows_linear(x[i:i + 1], w, b) for i in range(30)])
    torch.testing.assert_close(alone, F.linear(x, w, b), rtol=1e-5, atol=1e-5)
    for rows in (2, 3, 8, 13, 17, 30):
        assert torch.equal(kernels.rows_linear(x[:rows], w, b), alone[:rows])
    assert not kernels.supports(torch.randn(8, 20)) and not kernels.supports(torch.randn(64, 8).t())


@pytest.mark.skipif(not kernels.available(), reason="the C kernel does not build here")
def test_kernel_follows_a_weight_changed_in_place():
    # the packed copy kept beside a weight is remade after an optimizer step (a head validated while it trains)
    w = nn.Parameter(torch.randn(40, 32))
    x = torch.randn(3, 32)
    before = kernels.rows_linear(x, w, None)
    with torch.no_grad():
        w.mul_(2)
    torch.testing.assert_close(kernels.rows_linear(x, w, None), 2 * before)
    assert kernels.pack(w).shape == (2, 32, 32)  # 40 outputs: one block of 32 and one padded with zeros


def test_plan_covers_every_shape_and_bucket():
    model = nn.Sequential(nn.Linear(16, 48), nn.Linear(48, 16, bias=False), nn.Linear(16, 48))
    plan = calibrate(model, repeats=1)
    assert set(plan.layouts) == {"48x16", "16x48"}
    for by_bucket in plan.layouts.values():
        assert set(by_bucket) == set(BUCKETS) and set(by_bucket.values()) <= set(LAYOUTS)
    assert Plan.from_json(plan.to_json()) == plan
    assert plan.layout(model[0].weight, 3) == plan.layouts["48x16"][4]
    assert plan.layout(model[0].weight, 1000) == plan.layouts["48x16"][BUCKETS[-1]]  # beyond: the last bucket's


def test_plan_keeps_the_kernel_unless_another_layout_is_clearly_faster():
    # a 4 % difference is within this machine's noise; 6 % is taken
    assert fastpath._choose({"linear": 100.0, "wxt": 120.0, "kernel": 104.0}) == "kernel"
    assert fastpath._choose({"linear": 100.0, "wxt": 120.0, "kernel": 106.0}) == "linear"
    assert fastpath._choose({"linear": 100.0, "wxt": 90.0}) == "wxt"  # no kernel on this machine


def test_enable_then_remove_restores_the_stock_forward():
    model = nn.Sequential(nn.Linear(16, 48), nn.Linear(48, 16))
    params = list(model.parameters())
    wxt = Plan(layouts={k: {b: "wxt" for b in BUCKETS} for k in ("48x16", "16x48")})
    x = torch.randn(2, 3, 16)
    want = model(x)
    enable_fast_linear(model, wxt)
    assert all(type(m).__name__ == "PackedLinear" and isinstance(m, nn.Linear) for m in model)
    assert list(model.parameters()) == params and list(model.state_dict()) == ["0.weight", "0.bias", "1.weight",
                                                                                 "1.bias"]
    with torch.no_grad():
        torch.testing.assert_close(model(x), want)
    # with gradients the stock forward runs, so training is unaffected
    xg = x.clone().requires_grad_(True)
    model(xg).sum().backward()
    assert xg.grad is not None
    disable_fast_linear(model)
    assert all(type(m) is nn.Linear and not m.__dict__.keys() - nn.Linear(2, 2).__dict__.keys() for m in model)


def test_speculative_greedy_equals_plain_greedy_with_fast_linear_on_and_off():
    target = tiny_target(dtype=torch.float32)  # the backend is for float32 on the CPU
    dec = SpeculativeDecoder(target, tiny_head(target))
    prompt = [5, 9, 14, 22, 7]
    plain_off = dec.generate(prompt, max_new_tokens=24, speculative=False, cpu=CPUConfig(fast_path=False)).token_ids
    assert not fast_linear_enabled(target.model)
    plain_on = dec.generate(prompt, max_new_tokens=24, speculative=False).token_ids
    spec_on = dec.generate(prompt, max_new_tokens=24, num_speculative_tokens=3).token_ids
    assert fast_linear_enabled(target.model) and fast_linear_enabled(dec.head)
    assert isinstance(dec.head.fc, PackedLinear)  # the head's own layers, not only the lm_head it shares
    assert plain_on == plain_off == spec_on
    dec.generate(prompt, max_new_tokens=4, cpu=CPUConfig(fast_path=False))
    assert not fast_linear_enabled(target.model) and not fast_linear_enabled(dec.head)
    assert not any(isinstance(m, BackendModule) for m in target.model.modules())
    double = tiny_target()  # float64: the stock modules, the backend left out
    SpeculativeDecoder(double, tiny_head(double)).generate(prompt, max_new_tokens=4, num_speculative_tokens=3)
    assert not fast_linear_enabled(double.model)


def test_calibration_prefills_its_context_once_and_times_every_pass_after_it(tmp_path, monkeypatch):
    # a calibration times hundreds of passes over one cached context: prefilling that context anew for every
    # pass was a quarter of a fresh machine's first-decode calibration
    monkeypatch.setenv("EAGLE_CACHE", str(tmp_path))  # nothing cached: the calibration runs here
    target = tiny_target(dtype=torch.float32)
    dec = SpeculativeDecoder(target, tiny_head(target))
    lengths, features = [], target.features

    def counted(ids, *args, **kw):
        lengths.append(ids.shape[1])
        return features(ids, *args, **kw)

    monkeypatch.setattr(target, "features", counted)
    assert [dec._calibration_pass(rows, context=16) > 0 for rows in (1, 4, 2)] == [True] * 3
    assert lengths == [16, 1, 4, 2] and len(dec._calib[0]) == 16 + 2  # each pass cropped away before the next
    lengths.clear()
    dec._calib = None
    monkeypatch.setattr(fastpath, "BUCKETS", (1, 4))  # two row counts are enough to see the passes
    monkeypatch.setattr(plan, "BUCKETS", (1, 4))  # (and the plan's cache file names them)
    dec.use_fast_path(True)  # calibrates the target by whole passes after a 128-token context
    assert lengths.count(128) == 1 and set(lengths) == {128, 1, 4} and len(lengths) > 3
    assert dec._calib is None  # the context cache is not kept once the plan is made
    assert fast_linear_enabled(target.model)


@pytest.mark.skipif(not kernels.available(), reason="the C kernel does not build here")
def test_gated_and_norm_kernels_match_torch_and_give_each_row_the_same_bits():
    g = torch.Generator().manual_seed(2)
    gate, up, x = torch.randn(80, 64, generator=g), torch.randn(80, 64, generator=g), torch.randn(9, 64, generator=g)
    want = F.silu(x @ gate.T) * (x @ up.T)
    torch.testing.assert_close(kernels.rows_gated(x, gate, up), want, rtol=1e-4, atol=1e-4)
    w = torch.randn(64, generator=g)
    norm = w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5))
    torch.testing.assert_close(kernels.rms_norm(x, w, 1e-5), norm)
    for fn in (lambda rows: kernels.rows_gated(rows, gate, up), lambda rows: kernels.rms_norm(rows, w, 1e-5)):
        alone = torch.cat([fn(x[i:i + 1]) for i in range(9)])
        for rows in (2, 3, 9):  # two-block tiles up to 3 rows, one-block tiles above
            assert torch.equal(fn(x[:rows]), alone[:rows])


class _OnePlusNorm(nn.Module):
    """Gemma's RMS norm scales by 1 + weight: the patch-time check finds it, and its kernel adds the 1."""

    def __init__(self, dim):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(dim))
        self.eps = 1e-6

    def forward(self, x):
        return (1 + self.weight) * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps))


_OnePlusNorm.__name__ = "GemmaLikeRMSNorm"


@pytest.mark.skipif(not kernels.available(), reason="the C kernel does not build here")
def test_norms_and_gated_mlps_are_patched_only_where_the_kernel_matches_them():
    model = tiny_target(dtype=torch.float32).model  # the kernel takes float32
    model.add_module("odd_norm", _OnePlusNorm(model.config.hidden_size))
    ids = torch.tensor([[5, 9, 14, 22, 7, 3]])
    with torch.no_grad():
        want = model(ids).logits
        enable_fast_linear(model, Plan(layouts={}))  # every linear stock: the MLPs keep their stock forward
        assert not any(isinstance(m, BackendModule) for m in model.modules() if hasattr(m, "gate_proj"))
        disable_fast_linear(model)
        enable_fast_linear(model, Plan(layouts={k: {b: "kernel" for b in BUCKETS} for k in
                                                {f"{m.weight.shape[0]}x{m.weight.shape[1]}" for m in
                                                 model.modules() if isinstance(m, nn.Linear)}}))
        patched = {m.stock.__name__ for m in model.modules() if isinstance(m, BackendModule)
                   and not isinstance(m, nn.Linear)}
        # (enabling switched the attention to the backend's, so the base model runs all its layers in one call too)
        assert patched == {"LlamaRMSNorm", "LlamaMLP", "LlamaAttention", "LlamaDecoderLayer", "GemmaLikeRMSNorm",
                           "LlamaModel"}
        x = torch.randn(3, model.config.hidden_size)
        assert model.odd_norm.cpu_plan.offset == 1.0
        torch.testing.assert_close(model.odd_norm(x), _OnePlusNorm.forward(model.odd_norm, x))
        torch.testing.assert_close(model(ids).logits, want, rtol=1e-4, atol=1e-4)
        disable_fast_linear(model)
        assert not any(isinstance(m, BackendModule) for m in model.modules())
        assert torch.equal(model(ids).logits, want)


def test_attention_modules_and_layers_are_patched_bit_for_bit_and_only_plain_ones():
    # the fused attention forward (products, rotary embedding in C, cache update, kernel attention) and the one-call
    # decoder layer give exactly the stock forwards' numbers on a prefill and a tree-masked pass; a module with
    # another part keeps its own forward, and so does its layer
    from tests.test_attention import _verify_logits

    target = tiny_target(dtype=torch.float32, hidden=64, layers=3)
    target.model.model.layers[0].self_attn.add_module("q_norm", nn.Identity())  # not a plain Llama attention
    plan = Plan(layouts={f"{m.weight.shape[0]}x{m.weight.shape[1]}": {b: "kernel" for b in BUCKETS}
                         for m in target.model.modules() if isinstance(m, nn.Linear)})
    use_gqa_sdpa(target.model, True)
    enable_fast_linear(target.model, plan)
    layers = list(target.model.model.layers)
    attn = [layer.self_attn for layer in layers]
    assert [isinstance(a, KernelAttention) for a in attn] == [False, True, True]
    assert [isinstance(layer, FusedLayer) for layer in layers] == [False, True, True]
    g = torch.Generator().manual_seed(5)
    prefix, nodes = torch.randint(0, 96, (1, 9), generator=g), torch.randint(0, 96, (1, 6), generator=g)
    parents = torch.tensor([-1, 0, 0, 1, 2, 4])
    calls = []
    one_call = kernels.decoder_layer
    with torch.no_grad():
        kernels.decoder_layer = lambda x, *a: calls.append(x.shape[1]) or one_call(x, *a)
        try:
            one_call_layers = _verify_logits(target, prefix, nodes, parents)
        finally:
            kernels.decoder_layer = one_call
        assert calls == [6, 6]  # the prefill's causal mask is skipped (sdpa's is_causal): its layers run their parts
        for layer in layers[1:]:
            layer.to_stock()
        fused_attention = _verify_logits(target, prefix, nodes, parents)
        for a in attn[1:]:
            a.to_stock()
        stock = _verify_logits(target, prefix, nodes, parents)
    assert torch.equal(one_call_layers, stock) and torch.equal(fused_attention, stock)
    disable_fast_linear(target.model)
    use_gqa_sdpa(target.model, False)


@pytest.mark.skipif(not kernels.available(), reason="the C kernel does not build here")
def test_every_layer_in_one_call_gives_the_one_call_layers_bits():
    # a base model whose decoder layers all run in one call each runs them all in one C call (decoder_stack) for
    # tree-masked passes, causal passes after a cached past and one-row steps, with every layer's hidden states if
    # asked (EAGLE-3): bit for bit the layers' own numbers
    from tests.test_attention import _verify_logits

    target = tiny_target(dtype=torch.float32, hidden=64, layers=3)
    plan = Plan(layouts={f"{m.weight.shape[0]}x{m.weight.shape[1]}": {b: "kernel" for b in BUCKETS}
                         for m in target.model.modules() if isinstance(m, nn.Linear)})
    use_gqa_sdpa(target.model, True)
    enable_fast_linear(target.model, plan)
    base = target.model.model
    assert isinstance(base, FusedStack) and base.cpu_plan.rows[1] and base.cpu_plan.rows[64]
    g = torch.Generator().manual_seed(5)
    prefix, nodes = torch.randint(0, 96, (1, 9), generator=g), torch.randint(0, 96, (1, 6), generator=g)
    parents = torch.tensor([-1, 0, 0, 1, 2, 4])
    stack, calls = kernels.decoder_stack, []
    kernels.decoder_stack = lambda x, *a: calls.append(x.shape[1]) or stack(x, *a)
    try:
        with torch.no_grad():
            tree_pass = _verify_logits(target, prefix, nodes, parents)
            one_row = _verify_logits(target, prefix, nodes[:, :1], parents[:1])
            cache = TargetCache()
            target.features(prefix, position_ids=torch.arange(9)[None], cache=cache.hf)
            feats, hidden = target.hidden(nodes[:, :1], position_ids=torch.tensor([[9]]), cache=cache.hf, layers=[1])
            causal = target.features(nodes, position_ids=torch.arange(9, 15)[None], cache=_prefilled(target, prefix))
            assert calls == [6, 1, 1, 6]  # the prefill has no mask (sdpa's is_causal): its layers run their parts
            plan = base.cpu_plan
            base.to_stock()
            assert torch.equal(_verify_logits(target, prefix, nodes, parents), tree_pass)
            assert torch.equal(_verify_logits(target, prefix, nodes[:, :1], parents[:1]), one_row)
            want = target.hidden(nodes[:, :1], position_ids=torch.tensor([[9]]), cache=_prefilled(target, prefix),
                                 layers=[1])
            assert torch.equal(want[0], feats) and torch.equal(want[1], hidden)
            assert torch.equal(target.features(nodes, position_ids=torch.arange(9, 15)[None],
                                               cache=_prefilled(target, prefix)), causal)
            FusedStack.from_stock(base, plan)
            # a weight changed in place: the stack's table of addresses is made again (a new layout of it)
            base.layers[1].mlp.down_proj.weight.mul_(2)
            changed = target.features(nodes, position_ids=torch.arange(9, 15)[None], cache=_prefilled(target, prefix))
            assert calls[-1] == 6 and not torch.equal(changed, causal)
            base.to_stock()
            assert torch.equal(target.features(nodes, position_ids=torch.arange(9, 15)[None],
                                               cache=_prefilled(target, prefix)), changed)
            FusedStack.from_stock(base, plan)
    finally:
        kernels.decoder_stack = stack
    disable_fast_linear(target.model)
    assert not isinstance(base, BackendModule) and "cpu_plan" not in base.__dict__
    use_gqa_sdpa(target.model, False)


def test_rotary_table_rows_are_the_modules_own_bits():
    # the stack's rotary (cos, sin) come from a table the module made in one call: the same bits as the module's
    # own call at any positions, in any order; past the model's maximum the module's own call
    from cpu_backend.fused import StackPlan, _rotary

    target = tiny_target(dtype=torch.float32, hidden=64, layers=2)
    base = target.model.model
    size = base.config.max_position_embeddings
    x = torch.randn(1, 3, 64)
    g = torch.Generator().manual_seed(0)
    plan = StackPlan(dims=(), rows=[])
    for pos in [torch.arange(3), torch.randint(0, size, (3,), generator=g), torch.tensor([size - 1, 0, 7])]:
        want = base.rotary_emb(x, position_ids=pos[None])
        got = _rotary(base, plan, x, pos[None])
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert plan.rope[2].shape[1] == size  # 512 positions: the whole table at once
    past_end = torch.tensor([[size, size + 1, size + 2]])
    assert torch.equal(_rotary(base, plan, x, past_end)[0], base.rotary_emb(x, position_ids=past_end)[0])


def _prefilled(target, prefix):
    cache = TargetCache()  # the prefix read into a new cache
    target.features(prefix, position_ids=torch.arange(prefix.shape[1])[None], cache=cache.hf)
    return cache.hf


@pytest.mark.skipif(not kernels.available(), reason="the C kernel does not build here")
def test_kernel_products_give_f_linear_gradients():
    # a head trained with its linear layers patched: forward and backward products through the packed kernel
    g = torch.Generator().manual_seed(3)
    x = torch.randn(2, 19, 40, generator=g, requires_grad=True)
    w = torch.randn(70, 40, generator=g, requires_grad=True)
    b = torch.randn(70, generator=g, requires_grad=True)
    gy = torch.randn(2, 19, 70, generator=g)
    want = torch.autograd.grad(F.linear(x, w, b), (x, w, b), gy)
    got = torch.autograd.grad(kernels.linear_with_grad(x, w, b), (x, w, b), gy)
    for a, c in zip(got, want):
        assert a.shape == c.shape
        torch.testing.assert_close(a, c, rtol=1e-4, atol=1e-4)
    layer = nn.Linear(40, 70)
    enable_fast_linear(layer, Plan(layouts={"70x40": {r: "kernel" for r in BUCKETS}}))
    layer(x).sum().backward()  # the patched forward with gradients wanted
    assert layer.weight.grad is not None and x.grad is not None


@pytest.mark.skipif(not kernels.available(), reason="the C kernel does not build here")
def test_training_products_take_the_path_measured_faster(tmp_path, monkeypatch):
    """plan_training times the kernel's and F.linear's forward + backward per weight shape, caches the timings per
    machine, and each patched layer then trains through the faster one."""
    monkeypatch.setenv("EAGLE_CACHE", str(tmp_path))
    model = nn.Sequential(nn.Linear(64, 96), nn.Linear(96, 32))
    enable_fast_linear(model, Plan(layouts={"96x64": {r: "kernel" for r in BUCKETS},
                                            "32x96": {r: "kernel" for r in BUCKETS}}))
    timings = plan_training(model, rows=64, repeats=1)
    assert set(timings) == {"96x64", "32x96"} and all(set(t) == {"kernel", "linear"} for t in timings.values())
    assert [m.cpu_plan.train for m in model] == [timings[k]["kernel"] < timings[k]["linear"]
                                                 for k in ("96x64", "32x96")]
    monkeypatch.setattr(parts, "_time_training", None)  # the second time the cached timings decide
    assert plan_training(model, rows=64, repeats=1) == timings

    calls = []
    monkeypatch.setattr(kernels, "linear_with_grad", lambda *a: calls.append(1) or F.linear(*a))
    x = torch.randn(5, 64, requires_grad=True)
    for choice in (True, False):
        for m in model:
            m.cpu_plan.train = choice
        calls.clear()
        model(x).sum().backward()
        assert len(calls) == (2 if choice else 0)
    disable_fast_linear(model)
    assert not any(isinstance(m, BackendModule) or "cpu_plan" in m.__dict__ for m in model)


def _check_screen_against_the_kernel(seed: int) -> None:
    # ties (the first index wins), neighbours one float apart, rows that int8 cannot tell apart, a zero row, rows
    # of very different norms, a row of x along one of the weight's rows, and a NaN row (the fallback)
    g = torch.Generator().manual_seed(seed)
    for vocab, width in ((40, 32), (1000, 64), (3001, 96), (5000, 576)):
        w = torch.randn(vocab, width, generator=g) * torch.rand(vocab, 1, generator=g) * 3
        w[0] = 0
        for a, b in torch.randint(0, vocab, (6, 2), generator=g).tolist():
            w[b] = w[a]
        w[7] = torch.nextafter(w[3], torch.full_like(w[3], 100.0))
        w[11:30] = w[10] + torch.randn(19, width, generator=g) * 1e-4  # 20 rows within int8's error of each other
        for rows in (1, 2, 4, 5, 13, 30):  # tiles: byte products up to 4 rows, tile products from 5
            x = torch.randn(rows, width, generator=g)
            x[0] = w[10] * 2
            if rows == 5:
                x[3, 1] = float("nan")
            got = kernels.screen_argmax(x, w)
            want = kernels.rows_linear(x, w, None).argmax(-1)
            assert got.dtype == torch.int64 and got.shape == (rows,)
            assert torch.equal(got, want), (vocab, width, rows)
        assert torch.equal(kernels.screen_argmax(x[None], w), want[None])  # leading axes kept


def _check_screen_edge_cases() -> None:
    g = torch.Generator().manual_seed(11)
    # products that underflow: both logits round to 2^-148 in the kernel, a tie the first index wins
    w = torch.zeros(2, 32)
    w[0, 0], w[1, 0] = 0.5, 0.6
    x = torch.zeros(1, 32)
    x[0, 0] = 3 * 2.0 ** -149
    assert kernels.screen_argmax(x, w).tolist() == kernels.rows_linear(x, w, None).argmax(-1).tolist() == [0]
    w = torch.randn(300, 64, generator=g)
    w[5, 3] = 0.0
    x = torch.randn(4, 64, generator=g)
    x[0] = 0.0            # every output ties at 0: too many candidates, the whole product
    x[1, 3] = float("inf")  # 0 * inf = NaN in row 5's logit: torch's argmax takes the first NaN
    x[2] *= 1e30          # logits that may overflow
    want = kernels.rows_linear(x, w, None).argmax(-1)
    assert torch.equal(kernels.screen_argmax(x, w), want)
    w[7, 0] = float("nan")  # a weight with a NaN: no tables, the whole product
    assert kernels.screen_tables(w) is None
    assert torch.equal(kernels.screen_argmax(x, w), kernels.rows_linear(x, w, None).argmax(-1))


@pytest.mark.skipif(not kernels.available(), reason="the C kernel does not build here")
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("tiles", [True, False])
def test_screened_argmax_is_the_kernels_argmax_bit_for_bit(threads, tiles, monkeypatch):
    # tiles: the AMX layout where this machine has it (tile products from 5 rows; below, the pairs layout's second
    # copy, or with screen_tile_rows = 0 byte products on the tiles' layout), else the VNNI pairs' (or the float
    # path's)
    if tiles and not (kernels.library().screen_tiles() and kernels.amx_on()):
        pytest.skip("no AMX-INT8 here")
    force_switches(monkeypatch, amx=tiles)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for few in (5, 0) if tiles else (5,):
            force_switches(monkeypatch, screen_tile_rows=few)
            _check_screen_against_the_kernel(3 + threads)
            _check_screen_edge_cases()
    finally:
        torch.set_num_threads(before)


def test_screened_argmax_without_vnni(request, monkeypatch):
    # the int8-to-float path that CPUs without AVX512-VNNI take (the avx2 path), checked on a VNNI machine too
    reason = kernel_path_missing("avx2")
    if reason or not kernels.library().screen_pairs():
        pytest.skip(f"avx2 path: {reason}" if reason else "the native build already takes the float path")
    monkeypatch.setattr(kernels, "_lib", request.getfixturevalue("avx2_library"))
    monkeypatch.setattr(kernels, "_amx", None)
    assert not kernels._lib.screen_pairs()
    _check_screen_against_the_kernel(7)
    _check_screen_edge_cases()


@pytest.mark.skipif(not kernels.available(), reason="the C kernel does not build here")
def test_greedy_decoding_through_the_screen_gives_the_same_tokens(monkeypatch):
    target = tiny_target(dtype=torch.float32, hidden=64, vocab_size=96)
    head = tiny_head(target)
    kernel_everywhere = Plan(layouts={plan.shape_key(m.weight): {b: "kernel" for b in BUCKETS}
                                      for model in (target.model, head) for m in plan.linears(model)})
    for model in (target.model, head):  # the layouts the screen follows: the kernel's for every row count
        enable_fast_linear(model, plan=kernel_everywhere)
    calls = []
    screen = kernels.screen_argmax
    monkeypatch.setattr(kernels, "screen_argmax", lambda x, w: calls.append(x.shape[0]) or screen(x, w))
    dec = SpeculativeDecoder(target, head)
    prompt = [5, 9, 14, 22, 7]
    whole = dec.generate(prompt, max_new_tokens=24, speculative=False, cpu=CPUConfig(screen_argmax=False)).token_ids
    assert not calls
    plain = dec.generate(prompt, max_new_tokens=24, speculative=False).token_ids
    assert calls and set(calls) == {1}
    spec = dec.generate(prompt, max_new_tokens=24, num_speculative_tokens=3).token_ids
    assert 4 in calls  # verification passes of 1 + 3 tokens
    off = dec.generate(prompt, max_new_tokens=24, speculative=False, cpu=CPUConfig(fast_path=False)).token_ids
    assert plain == whole == spec == off
