"""The head's shapes, checkpoints (bit-exact, atomic, strict), target compatibility, and typed configs."""

import json
from pathlib import Path

import pytest
import torch
from tiny import tiny_head, tiny_target

from cpu_backend import kernels
from eagle import CheckpointError, EagleHead, HeadConfig
from eagle.configio import ConfigError, load_config
from train.config import TrainConfig

ROOT = Path(__file__).resolve().parents[1]


def test_head_shapes_and_draft_vocab():
    t = tiny_target()
    head = tiny_head(t)
    f = torch.randn(2, 5, 32, dtype=torch.float64)
    ids = torch.randint(0, 96, (2, 5))
    h = head(f, ids, torch.arange(5)[None].expand(2, -1))
    assert h.shape == (2, 5, 32) and head.logits(h).shape == (2, 5, 96)
    small = EagleHead(HeadConfig.for_target(t, draft_vocab_size=10)).to(torch.float64).attach(t)
    d2t = torch.tensor([2, 3, 5, 7, 11, 13, 17, 19, 23, 29])
    small.set_draft_vocab(d2t)
    logits = small.logits(h)
    assert logits.shape == (2, 5, 10)
    torch.testing.assert_close(logits, t.lm_head(h)[..., d2t])
    assert small.to_target_ids(torch.tensor([0, 9])).tolist() == [2, 29]


def test_save_load_bit_exact_and_shared_weights_not_saved(tmp_path):
    t = tiny_target()
    head = EagleHead(HeadConfig.for_target(t, draft_vocab_size=8)).to(torch.float64).attach(t)
    head.set_draft_vocab(torch.arange(8) * 3)
    head.save_pretrained(tmp_path / "h")
    assert sorted(p.name for p in (tmp_path / "h").iterdir()) == ["config.json", "model.safetensors"]
    back = EagleHead.from_pretrained(tmp_path / "h", dtype=torch.float64).attach(t)
    a, b = head.trainable_state_dict(), back.trainable_state_dict()
    assert a.keys() == b.keys() and not any(k.startswith(("embed_tokens", "lm_head")) for k in a)
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert back.config == head.config


def test_checkpoint_errors_name_the_problem(tmp_path):
    t = tiny_target()
    tiny_head(t).save_pretrained(tmp_path / "h")
    with pytest.raises(CheckpointError, match="no config.json"):
        EagleHead.from_pretrained(tmp_path / "nothing")
    cfg = json.loads((tmp_path / "h/config.json").read_text())
    cfg["intermediate_size"] = 99
    (tmp_path / "h/config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="wrong shape: layers.0.mlp.gate_proj.weight"):
        EagleHead.from_pretrained(tmp_path / "h")


def test_head_for_another_target_is_refused(tmp_path):
    head = tiny_head(tiny_target())
    other = tiny_target(vocab_size=120, hidden=48)
    with pytest.raises(CheckpointError, match="hidden size 32 vs 48, vocab size 96 vs 120"):
        head.attach(other)


def test_every_preset_loads():
    presets = sorted((ROOT / "configs").glob("*.yaml"))
    assert presets
    for p in presets:
        cfg = load_config(TrainConfig, p)
        assert isinstance(cfg, TrainConfig)


def test_the_smollm2_presets_differ_only_in_the_head():
    """Issue 4: the EAGLE-1 and EAGLE-3 presets compare heads, so data, optimiser, budget and evaluation match; the
    loss differs only where the heads' methods do (feature regression, the training-time test)."""
    e1 = load_config(TrainConfig, ROOT / "configs/smollm2-135m-eagle1.yaml")
    e3 = load_config(TrainConfig, ROOT / "configs/smollm2-135m-eagle3.yaml")
    assert (e1.data, e1.optim, e1.budget, e1.eval) == (e3.data, e3.optim, e3.budget, e3.eval)
    assert (e1.model.head_type, e3.model.head_type) == ("eagle1", "eagle3")
    e3.model.head_type, e3.model.feature_layers = e1.model.head_type, e1.model.feature_layers
    assert e1.model == e3.model
    assert e1.loss.noise == e3.loss.noise
    # the EAGLE-1 preset scores prompt positions too (measured for EAGLE-1 only: BENCHMARKS.md); a comparison of the
    # two heads sets loss.positions alike
    assert (e1.loss.positions, e3.loss.positions) == ("all", "assistant")


def test_overrides_are_typed_and_unknown_keys_rejected(tmp_path):
    cfg = load_config(TrainConfig, ROOT / "configs/smollm2-135m-eagle1.yaml",
                      ["optim.lr=5e-4", "budget.minutes=2", "model.draft_vocab=4096", "optim.betas=[0.8,0.9]"])
    assert cfg.optim.lr == 5e-4 and cfg.budget.minutes == 2.0 and cfg.model.draft_vocab == 4096
    assert cfg.optim.betas == [0.8, 0.9]
    with pytest.raises(ConfigError, match="unknown config key 'optim.lrr'"):
        load_config(TrainConfig, None, ["optim.lrr=1"])
    with pytest.raises(ConfigError, match="'budget.minutes' must be float"):
        load_config(TrainConfig, None, ["budget.minutes=soon"])
    bad = tmp_path / "bad.yaml"
    bad.write_text("model:\n  targett: x\n")
    with pytest.raises(ConfigError, match="unknown config key 'model.targett'"):
        load_config(TrainConfig, bad)
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(TrainConfig, tmp_path / "missing.yaml")


def test_gguf_conversion_cache_is_keyed_by_content_not_path(tmp_path, monkeypatch):
    from eagle.target import _gguf_cache_dir

    monkeypatch.setenv("EAGLE_CACHE", str(tmp_path / "cache"))
    blob = bytes(range(256)) * 9000  # > 2 MiB, so head and tail are read separately
    a, b, c = tmp_path / "a" / "m.gguf", tmp_path / "b" / "m.gguf", tmp_path / "c" / "m.gguf"
    for f, data in ((a, blob), (b, blob), (c, blob[:-1] + b"x")):
        f.parent.mkdir()
        f.write_bytes(data)
    assert _gguf_cache_dir(a) == _gguf_cache_dir(b)  # the same package in another virtual environment
    assert _gguf_cache_dir(a) != _gguf_cache_dir(c)
    assert _gguf_cache_dir(a).name.startswith("m-")


@pytest.mark.skipif(not kernels.available(), reason="the C kernel does not build here")
def test_rotary_tables_give_the_values_computed_on_the_spot():
    # rope_cos_sin gathers rows of a table that grows with the largest position asked; each value is computed alone
    # in float64 and cast, so it must equal computing it for the asked positions only, bit for bit
    from eagle.head import rope_cos_sin

    def on_the_spot(pos, head_dim, theta, dtype):
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
        emb = torch.cat([pos[..., None].double() * inv_freq] * 2, dim=-1)
        return emb.cos().to(dtype)[:, None], emb.sin().to(dtype)[:, None]

    for pos in (torch.tensor([[255]]), torch.arange(300)[None], torch.tensor([[9000, 7, 5000]]),
                torch.randint(0, 20000, (3, 17), generator=torch.Generator().manual_seed(0))):
        for dtype in (torch.float32, torch.bfloat16):
            for got, want in zip(rope_cos_sin(pos, 64, 1e5, dtype), on_the_spot(pos, 64, 1e5, dtype)):
                assert got.shape == want.shape == (pos.shape[0], 1, pos.shape[1], 64) and torch.equal(got, want)


@pytest.mark.parametrize("layers", [1, 2])
@pytest.mark.skipif(not kernels.available(), reason="the C kernel does not build here")
def test_head_layer_in_c_matches_torch_when_drafting(monkeypatch, layers):
    # drafting on the CPU in float32, the backend runs each head layer in one C call (norms, products, rotary
    # embedding, attention; a second layer has an input norm, the first none): a prefill, a one-row step and a
    # tree-masked step with the head's own cache give what the plain torch head gives, to float32 rounding
    from cpu_backend import draft, fastpath
    from eagle.head import HeadCache

    target = tiny_target(dtype=torch.float32, hidden=64)
    head = tiny_head(target, num_layers=layers)
    g = torch.Generator().manual_seed(0)
    feats, ids = torch.randn(1, 9, 64, generator=g), torch.randint(0, 96, (1, 9), generator=g)
    tree_mask = torch.tensor([[True] * 8 + [True, False, False], [True] * 8 + [False, True, False],
                              [True] * 8 + [True, False, True]])

    def run() -> list[torch.Tensor]:
        cache = HeadCache()
        with torch.inference_mode():
            out = [head(feats[:, :7], ids[:, :7], torch.arange(7)[None], cache=cache)]
            out.append(head(feats[:, 7:8], ids[:, 7:8], torch.tensor([[7]]), cache=cache))
            out.append(head(feats[:, 8:9].expand(1, 3, 64), ids[:, 8:9].expand(1, 3), torch.full((1, 3), 8),
                            cache=cache, mask=tree_mask))
        return out

    plain = run()
    calls, original = [], kernels.decoder_layer
    monkeypatch.setattr(kernels, "decoder_layer", lambda *a: calls.append(1) or original(*a))
    draft.patch(head)
    fast = run()
    assert len(calls) == 3 * layers  # every layer of every call took the C path
    draft.unpatch(head)
    fastpath.disable_fast_linear(head)  # the patched forwards off
    again = run()
    for got, want, same in zip(fast, plain, again):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        assert torch.equal(same, want)  # the plain head again


@pytest.mark.skipif(not kernels.available(), reason="the C kernel does not build here")
def test_head_layer_in_c_leaves_a_dropping_head_to_torch(monkeypatch):
    # the one-call C layer has no dropout: a patched head in training mode with a dropout rate runs the torch layer
    # (which drops), and in eval mode the C layer again
    from cpu_backend import draft, fastpath
    from eagle.head import HeadCache

    target = tiny_target(dtype=torch.float32, hidden=64)
    head = tiny_head(target)
    g = torch.Generator().manual_seed(0)
    feats, ids = torch.randn(1, 5, 64, generator=g), torch.randint(0, 96, (1, 5), generator=g)
    calls, original = [], kernels.decoder_layer
    monkeypatch.setattr(kernels, "decoder_layer", lambda *a: calls.append(1) or original(*a))
    draft.patch(head)

    def run(training: bool) -> torch.Tensor:
        head.train(training)
        head.set_dropout(0.5, torch.Generator().manual_seed(1))
        with torch.inference_mode():
            return head(feats, ids, torch.arange(5)[None], cache=HeadCache())

    dropped = run(True)
    assert calls == []
    kept = run(False)
    assert len(calls) == 1 and not torch.allclose(dropped, kept)
    draft.unpatch(head)
    fastpath.disable_fast_linear(head)


def test_two_layer_head_cache_save_load_and_lossless_decoding(tmp_path):
    # a head of two decoder layers (model.num_layers): the cached, step-by-step forward equals one forward over
    # every token, the checkpoint keeps both layers, and decoding with it gives plain greedy's tokens
    from eagle.head import HeadCache
    from infer import SpeculativeDecoder

    target = tiny_target()
    head = tiny_head(target, num_layers=2)
    assert len(head.layers) == 2 and head.layers[0].input_layernorm is None and head.layers[1].input_layernorm
    g = torch.Generator().manual_seed(0)
    feats, ids = torch.randn(1, 6, 32, generator=g, dtype=torch.float64), torch.randint(0, 96, (1, 6), generator=g)
    whole = head(feats, ids, torch.arange(6)[None])
    cache = HeadCache()
    steps = [head(feats[:, :3], ids[:, :3], torch.arange(3)[None], cache=cache)]
    steps += [head(feats[:, i:i + 1], ids[:, i:i + 1], torch.tensor([[i]]), cache=cache) for i in range(3, 6)]
    torch.testing.assert_close(torch.cat(steps, dim=1), whole)
    assert len(cache.k) == 2
    head.save_pretrained(tmp_path / "h")
    again = EagleHead.from_pretrained(tmp_path / "h", dtype=torch.float64).attach(target)
    assert again.config.num_layers == 2
    for (k, a), (k2, b) in zip(head.trainable_state_dict().items(), again.trainable_state_dict().items()):
        assert k == k2 and torch.equal(a, b), k
    dec = SpeculativeDecoder(target, again)
    prompt = [5, 6, 7, 8, 9, 10, 11]
    base = dec.generate(prompt, 32, speculative=False).token_ids
    assert dec.generate(prompt, 32, num_speculative_tokens=4).token_ids == base
    assert dec.generate(prompt, 32, mode="dynamic", top_k=3, depth=3, total_tokens=7).token_ids == base
    with pytest.raises(ValueError, match="num_layers=0"):
        EagleHead(HeadConfig.for_target(target, num_layers=0))
