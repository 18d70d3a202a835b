"""EAGLE-3 heads: shapes, the draft vocabulary maps, checkpoints, lossless decoding, one training step."""

import torch
from tiny import tiny_target

from eagle import EagleHead, HeadConfig
from eagle.head import Eagle3Head, eagle3_layers, make_head
from infer import SpeculativeDecoder

PROMPT = [5, 9, 14, 22, 7, 31, 3]


def eagle3_head(target, draft_vocab=40, seed=1, **variant):
    torch.manual_seed(seed)
    cfg = HeadConfig.for_target(target, head_type="eagle3", feature_layer_ids=[0, 1, 2], draft_vocab_size=draft_vocab,
                                **variant)
    head = make_head(cfg).to(target.dtype).attach(target)
    head.set_draft_vocab(torch.arange(4, 4 + 2 * draft_vocab, 2))
    return head


def test_shapes_and_vocabulary_maps():
    target = tiny_target()
    head = eagle3_head(target)
    assert isinstance(head, Eagle3Head) and head.fc.in_features == 3 * target.hidden_size
    assert head.layers[0].self_attn.q_proj.in_features == 2 * target.hidden_size
    feats = torch.randn(2, 5, 3 * target.hidden_size, dtype=torch.float64)
    ids = torch.randint(0, 90, (2, 5))
    h = head(feats, ids, torch.arange(5)[None].expand(2, -1))
    assert h.shape == (2, 5, target.hidden_size)
    assert head(h, ids, torch.arange(5)[None].expand(2, -1)).shape == h.shape  # its own hidden as the next input
    assert head.logits(h).shape == (2, 5, 40)
    # d2t / t2d round trip: every draft index maps to a target id marked in t2d, and nothing else is marked
    assert head.t2d.sum() == 40 and head.t2d[head.d2t].all()
    back = torch.full((target.vocab_size,), -1)
    back[head.d2t] = torch.arange(40)
    assert torch.equal(head.to_target_ids(back[head.d2t]), head.d2t)
    assert eagle3_layers(30) == [2, 15, 27]


def test_save_load_bit_exact(tmp_path):
    target = tiny_target()
    head = eagle3_head(target)
    head.save_pretrained(tmp_path / "h")
    again = EagleHead.from_pretrained(tmp_path / "h", dtype=torch.float64).attach(target)
    assert isinstance(again, Eagle3Head)
    for (k, a), (k2, b) in zip(head.trainable_state_dict().items(), again.trainable_state_dict().items()):
        assert k == k2 and torch.equal(a, b), k
    assert "draft_head.weight" in head.trainable_state_dict() and "t2d" in head.trainable_state_dict()


def test_eagle3_greedy_decoding_equals_plain_greedy():
    target = tiny_target()
    dec = SpeculativeDecoder(target, eagle3_head(target))
    base = dec.generate(PROMPT, 40, speculative=False)
    for cfg in (dict(num_speculative_tokens=4), dict(mode="dynamic", top_k=3, depth=3, total_tokens=7),
                dict(mode="static", tree="[[0], [1], [0, 0]]")):
        assert dec.generate(PROMPT, 40, **cfg).token_ids == base.token_ids


def test_draft_readout_starts_as_the_targets():
    """After init_from_target_lm_head(target), the head's readout norm(h) -> draft_head is the target's own
    final norm and lm_head over the draft vocabulary (Llama stores the norm's gain as w, Gemma as 1 + w)."""
    target = tiny_target()
    with torch.no_grad():
        target.base.norm.weight.copy_(torch.rand(target.hidden_size, dtype=torch.float64) * 2 + 0.5)
    head = eagle3_head(target)
    head.init_from_target_lm_head(target)
    h = torch.randn(3, target.hidden_size, dtype=torch.float64) * 5
    assert torch.allclose(head.logits(h), target.lm_head(target.base.norm(h))[:, head.d2t], atol=1e-9)


def test_eagle31_norms_each_fused_layer_and_feeds_the_normed_output_on(tmp_path):
    """EAGLE-3.1: fc reads each target layer RMS-normed on its own; the hidden passed to the next step (and read by
    the draft lm_head) is the normed output. Saved and loaded exactly; greedy decoding stays lossless."""
    target = tiny_target()
    head = eagle3_head(target, fc_norm=True, norm_output=True)
    with torch.no_grad():
        for i, norm in enumerate(head.fc_norm):
            norm.weight.copy_(torch.linspace(0.5, 1.5, target.hidden_size) * (i + 1))
    H = target.hidden_size
    feats = torch.randn(1, 4, 3 * H, dtype=torch.float64)
    scaled = torch.cat([feats[..., :H] * 30, feats[..., H:2 * H], feats[..., 2 * H:] * 0.5], dim=-1)
    ids, pos = torch.randint(0, 90, (1, 4)), torch.arange(4)[None]
    h = head(feats, ids, pos)
    torch.testing.assert_close(head(scaled, ids, pos), h, rtol=1e-4, atol=1e-4)  # each layer's scale normed away
    torch.testing.assert_close(h, head.norm(h), rtol=1e-4, atol=1e-4)  # the output is normed already (RMSNorm of RMSNorm, same gain 1)
    torch.testing.assert_close(head.logits(h), head.draft_head(h))
    head.save_pretrained(tmp_path / "h")
    again = EagleHead.from_pretrained(tmp_path / "h", dtype=torch.float64).attach(target)
    assert again.config.fc_norm and again.config.norm_output
    torch.testing.assert_close(again(feats, ids, pos), h, rtol=0, atol=0)
    dec = SpeculativeDecoder(target, head)
    base = dec.generate(PROMPT, 40, speculative=False)
    assert dec.generate(PROMPT, 40, num_speculative_tokens=4).token_ids == base.token_ids
