"""Integration tests on the real SmolLM2-135M-Instruct target (converted from its GGUF file once, then cached)."""

import json

import pytest
import torch
from paths import force_switches
from test_decoding import OracleProposer

from eagle import EagleHead, HeadConfig, load_target
from eagle.configio import load_config
from cpu_backend import CPUConfig
from infer import SpeculativeDecoder
from train.config import TrainConfig

pytestmark = pytest.mark.smollm

PROMPTS = ["What is the capital of France?", "Write a haiku about autumn leaves.",
           "Explain in two sentences why the sky is blue."]


@pytest.fixture(scope="module")
def target():
    return load_target("smollm2-135m")


@pytest.fixture(scope="module")
def baselines(target):
    dec = SpeculativeDecoder(target, None)
    return [dec.generate(p, 40, speculative=False) for p in PROMPTS]


def test_engine_greedy_equals_transformers_greedy_with_fast_linear_on_and_off(target, baselines):
    dec = SpeculativeDecoder(target, None)
    whole = [dec.generate(p, 40, speculative=False, cpu=CPUConfig(screen_argmax=False)).token_ids for p in PROMPTS]
    off = [dec.generate(p, 40, speculative=False, cpu=CPUConfig(fast_path=False)).token_ids for p in PROMPTS]
    assert not any("cpu_plan" in m.__dict__ or type(m).__name__.startswith(("Packed", "Kernel", "Fused"))
               for m in target.model.modules())  # the stock layers are back
    for p, base, lm_head, plain in zip(PROMPTS, baselines, whole, off):
        ids = torch.tensor([dec.encode(p)])
        hf = target.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=40, do_sample=False,
                                   eos_token_id=target.eos_ids)[0, ids.shape[1]:].tolist()
        # the baselines ran with the fast layouts and greedy tokens through the int8 screen (the defaults)
        assert base.token_ids == lm_head == plain == hf


def test_chain_decoding_is_lossless_with_a_random_head(target, baselines):
    torch.manual_seed(0)
    head = EagleHead(HeadConfig.for_target(target, draft_vocab_size=512)).attach(target)
    head.set_draft_vocab(torch.arange(512) * 64)
    dec = SpeculativeDecoder(target, head)
    for p, base in zip(PROMPTS, baselines):
        assert dec.generate(p, 40, num_speculative_tokens=4).token_ids == base.token_ids


def test_chain_drafts_through_the_screen_are_the_draft_logits_argmax(target, baselines, monkeypatch):
    """Greedy chain drafts take the head's argmax through the int8 screen of its draft lm_head rows (through
    `kernels.screen_argmax` or `GreedySteps`'s own call): the same drafts (so the same accepted lengths) as the
    argmax of the whole draft logits, and the target's greedy tokens."""
    from cpu_backend import kernels
    from cpu_backend.draft import GreedySteps

    torch.manual_seed(0)
    head = EagleHead(HeadConfig.for_target(target, draft_vocab_size=512)).attach(target)
    head.set_draft_vocab(torch.arange(512) * 64)
    dec = SpeculativeDecoder(target, head)
    screen, step, drafted = kernels.screen_argmax, GreedySteps.step, []
    monkeypatch.setattr(kernels, "screen_argmax",
                        lambda x, w: drafted.append(w is head.draft_lm_weight) or screen(x, w))
    monkeypatch.setattr(GreedySteps, "step", lambda self, *a: drafted.append(True) or step(self, *a))
    for p, base in zip(PROMPTS[:2], baselines):
        on = dec.generate(p, 40, num_speculative_tokens=2)
        off = dec.generate(p, 40, num_speculative_tokens=2, cpu=CPUConfig(screen_argmax=False))
        assert on.token_ids == off.token_ids == base.token_ids and on.accept_lengths == off.accept_lengths
    assert any(drafted)


def test_smollm2_weights_are_read_as_q4_1_codes_with_the_same_bits(target, baselines, monkeypatch):
    """Every decoder weight of SmolLM2 (a GGUF Q4_1 file) is found in Q4_1 form and read as codes, 0.75 bytes a
    weight instead of 4: on the FMA path a tree-masked verification pass gives the float32 copies' features bit for
    bit; on AMX tiles or VNNI byte products (other bits) its first row gives the one-token step's features bit for
    bit."""
    from cpu_backend import kernels
    from infer.cache import TargetCache

    if not (kernels.available() and kernels.library().q4_supported()):
        pytest.skip("no Q4_1 path in the kernel here")
    layers = target.model.model.layers
    weights = [m.weight for m in layers.modules() if isinstance(m, torch.nn.Linear)]
    assert len(weights) == 7 * len(layers) and all(kernels.q4_1_codes(w) is not None for w in weights)
    dec = SpeculativeDecoder(target, None)
    dec.use_fast_path(True)
    ids = torch.tensor([dec.encode(PROMPTS[0])])
    n = ids.shape[1]
    tree = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 0, 1, 1]], dtype=torch.bool)
    mask = torch.cat([torch.ones(4, n, dtype=torch.bool), tree], dim=1)[None, None]
    new = torch.tensor([baselines[0].token_ids[:4]])
    feats = []
    with torch.inference_mode():
        for on, fast in ((True, False), (False, False), (True, True)):
            force_switches(monkeypatch, q4_1=on)
            force_switches(monkeypatch, amx=fast)
            force_switches(monkeypatch, vnni=fast)
            cache = TargetCache()
            target.features(ids, position_ids=torch.arange(n)[None], cache=cache.hf)
            step = target.features(new[:, :1], position_ids=torch.tensor([[n]]), cache=cache.hf)
            cache.crop(n)
            tree_pass = target.features(new, position_ids=torch.tensor([[n, n + 1, n + 1, n + 2]]),
                                        cache=cache.hf, attention_mask=mask)
            feats.append((step, tree_pass))
            vnni = fast and kernels.library().vq_supported()
            assert kernels.packed(weights[0]) & 15 == (0 if not on else 2 if kernels.amx_on() else 9 if vnni else 1)
    dec.use_fast_path(False)
    assert torch.equal(feats[0][0], feats[1][0]) and torch.equal(feats[0][1], feats[1][1])
    step, tree_pass = feats[2]
    assert torch.equal(step[:, 0], tree_pass[:, 0])
    # its lm_head (the embedding, GGUF Q8_0) is read as int8 codes for the whole logits (sampling): a quarter of the
    # float32 bytes, the same logits bit for bit (the greedy screen read it: no byte products)
    lm = target.lm_head.weight
    kernels.screen_tables(lm)  # as greedy decoding did (the tables are kept)
    rows = tree_pass[0].contiguous()
    logits = []
    with torch.inference_mode():
        for on in (True, False):
            force_switches(monkeypatch, q4_1=on)
            assert kernels.packed(lm) & 15 == (5 if on else 0)
            logits.append(kernels.rows_linear(rows, lm, None))
    assert torch.equal(*logits)
    kernels.unpack(lm)  # the float32 copy's 113 MB back
    assert torch.allclose(tree_pass, feats[1][1], rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("wrong_at", [None, 2])
def test_oracle_drafts_on_smollm2(target, baselines, wrong_at):
    for p, base in zip(PROMPTS, baselines):
        dec = SpeculativeDecoder(target, None)
        truth = dec.encode(p) + base.token_ids
        dec.proposer = OracleProposer(truth, wrong_at, target.vocab_size)
        out = dec.generate(p, 40, num_speculative_tokens=5)
        assert out.token_ids == base.token_ids
        full = [a for a in out.accept_lengths[:-1]]
        assert full == [5 if wrong_at is None else wrong_at] * len(full)


def test_smollm2_drafting_for_itself_accepts_every_token(target, baselines):
    """A draft model's one-token passes give the bits of the target's verification rows (the kernels compute each
    row alone), so the target drafting for itself is accepted whole, every round."""
    dec = SpeculativeDecoder.from_pretrained(target, draft_model=target)
    out = dec.generate(PROMPTS[0], 40, num_speculative_tokens=4)
    assert out.token_ids == baselines[0].token_ids
    assert out.accept_lengths == [4] * len(out.accept_lengths)


def test_prep_then_a_few_training_steps_lower_the_loss(target, tmp_path):
    from data_prep.prep import PrepConfig, prepare
    from train.loop import train

    s = prepare(PrepConfig(target="smollm2-135m", data="sharegpt", out=str(tmp_path / "data"), max_rows=20,
                           max_length=512, max_turns=1), target=target)
    assert s.kept >= 5
    cfg = load_config(TrainConfig, None, [f"data.prepared={tmp_path / 'data'}", f"run_dir={tmp_path / 'run'}",
                                          f"out={tmp_path / 'head'}", "budget.max_steps=12", "optim.batch_tokens=1024",
                                          "optim.warmup_steps=2", "model.draft_vocab=2048", "log_every=1",
                                          "eval.num_prompts=1", "eval.max_new_tokens=8"])
    train(cfg, target=target)
    losses = [json.loads(l)["loss"] for l in (tmp_path / "run/log.jsonl").read_text().splitlines()
              if "loss" in json.loads(l)]
    assert sum(losses[-3:]) < sum(losses[:3])
    head = EagleHead.from_pretrained(tmp_path / "head").attach(target)
    assert head.config.draft_vocab_size == 2048 and head.config.target == "smollm2-135m"


def test_eagle3_decoding_is_lossless_with_a_random_head(target, baselines, monkeypatch):
    """An EAGLE-3 head reads three target layers: the verification passes keep them from the one call of all layers
    (`kernels.decoder_stack`), and decoding stays the target's own greedy."""
    from cpu_backend import kernels
    from eagle.head import eagle3_layers, make_head

    torch.manual_seed(0)
    cfg = HeadConfig.for_target(target, head_type="eagle3", feature_layer_ids=eagle3_layers(target.num_layers),
                                draft_vocab_size=512)
    head = make_head(cfg).attach(target)
    head.set_draft_vocab(torch.arange(512) * 64)
    stack, kept = kernels.decoder_stack, []
    monkeypatch.setattr(kernels, "decoder_stack", lambda *a, **kw: kept.append(a[-1] is not None) or stack(*a, **kw))
    dec = SpeculativeDecoder(target, head)
    for p, base in zip(PROMPTS[:2], baselines):
        assert dec.generate(p, 40, num_speculative_tokens=3).token_ids == base.token_ids
    assert kept and all(kept)
