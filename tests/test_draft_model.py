"""A small causal LM as the draft (`ModelProposer`): lossless chains, exact acceptance when it is the target
itself, sampling that keeps the target's distribution, and one-line errors."""

import pytest
from tiny import tiny_target

from infer import SpeculativeDecoder
from infer.proposer import ModelProposer

PROMPT = [5, 6, 7, 8, 9, 10, 11]


@pytest.fixture(scope="module")
def target():
    return tiny_target()


@pytest.fixture(scope="module")
def baseline(target):
    return SpeculativeDecoder(target, None).generate(PROMPT, 40, speculative=False)


@pytest.mark.parametrize("k", [1, 3, 5])
def test_the_target_drafting_for_itself_accepts_every_token(target, baseline, k):
    dec = SpeculativeDecoder.from_pretrained(target, draft_model=target)
    out = dec.generate(PROMPT, 40, num_speculative_tokens=k)
    assert out.token_ids == baseline.token_ids
    assert out.accept_lengths == [k] * len(out.accept_lengths)
    assert out.rounds == -(-(len(baseline.token_ids) - 1) // (k + 1))  # the prefill emits the first token


def test_the_target_sampling_for_itself_accepts_every_token(target):
    """q = p, so every draft passes min(1, p / q) = 1: the draft's true probabilities reach the acceptance rule."""
    import torch

    dec = SpeculativeDecoder.from_pretrained(target, draft_model=target)
    g = torch.Generator().manual_seed(0)
    out = dec.generate(PROMPT, 30, num_speculative_tokens=3, temperature=1.0, generator=g)
    assert out.accept_lengths == [3] * len(out.accept_lengths)


@pytest.mark.parametrize("cfg", [dict(num_speculative_tokens=3), dict(num_speculative_tokens=2,
                                                                      prompt_lookup_num_tokens=4,
                                                                      prompt_lookup_min=1)])
def test_another_model_drafting_is_lossless(target, baseline, cfg):
    dec = SpeculativeDecoder.from_pretrained(target, draft_model=tiny_target(seed=5))
    out = dec.generate(PROMPT, 40, **cfg)
    assert out.token_ids == baseline.token_ids
    import torch

    assert dec.generate(PROMPT, 40, generator=torch.Generator(), **cfg).token_ids == baseline.token_ids  # greedy
    again = dec.generate(PROMPT, 40, **cfg)  # the proposer starts over: same rounds
    assert again.accept_lengths == out.accept_lengths


def test_sampling_with_a_draft_model_reproduces_the_target_distribution():
    from test_trees import _tv_test

    target, draft = tiny_target(vocab_size=24, seed=3), tiny_target(vocab_size=24, seed=7)
    for m in (target, draft):
        m.model.lm_head.weight.mul_(0.15)
    dec = SpeculativeDecoder.from_pretrained(target, draft_model=draft)
    tv, noise = _tv_test(target, dec, dict(num_speculative_tokens=2, temperature=0.9), trials=600)
    assert tv < 1.5 * noise + 0.01, (tv, noise)


def test_draft_model_errors_are_one_line(target):
    with pytest.raises(ValueError, match="tokenizer differs from the target's") as e:
        ModelProposer(tiny_target(vocab_size=40), target)
    assert "\n" not in str(e.value)
    dec = SpeculativeDecoder.from_pretrained(target, draft_model=target)
    with pytest.raises(ValueError, match="a draft model drafts chains only"):
        dec.generate(PROMPT, 8, mode="dynamic")
    with pytest.raises(ValueError, match="not both"):
        SpeculativeDecoder.from_pretrained(target, "some/head", draft_model=target)
