"""Gemma-3-270M (a base model with a 262k vocabulary) as a target: assembled from its chunk packages, converted
once, given the plain dialogue template, decoded losslessly. Slow the first time (about 2 minutes to convert)."""

import pytest
import torch

from eagle import EagleHead, HeadConfig, load_target
from eagle.target import PLAIN_TEMPLATE
from infer import SpeculativeDecoder

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def target():
    return load_target("gemma3-270m")


def test_gemma_loads_with_the_plain_template(target):
    assert target.vocab_size == 262144 and target.tokenizer.chat_template == PLAIN_TEMPLATE
    dec = SpeculativeDecoder(target, None)
    assert dec.encode("Hi")[:1] == [target.tokenizer.bos_token_id]


def test_gemma_chain_and_tree_decoding_are_lossless(target):
    torch.manual_seed(0)
    head = EagleHead(HeadConfig.for_target(target, draft_vocab_size=1024)).attach(target)
    head.set_draft_vocab(torch.arange(1024) * 200)
    dec = SpeculativeDecoder(target, head)
    prompt = "Name three colours."
    base = dec.generate(prompt, 24, speculative=False)
    ids = torch.tensor([dec.encode(prompt)])
    hf = target.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=24, do_sample=False,
                               eos_token_id=target.eos_ids)[0, ids.shape[1]:].tolist()
    assert base.token_ids == hf
    assert dec.generate(prompt, 24, num_speculative_tokens=3).token_ids == base.token_ids
    assert dec.generate(prompt, 24, mode="dynamic", top_k=3, depth=3, total_tokens=6).token_ids == base.token_ids


def test_gemma_past_its_sliding_window_decodes_as_transformers(target):
    # Gemma-3's sliding layers see the last 512 positions: a 600-token prompt, read in chunks and verified in tree
    # passes with explicit masks, must give transformers' own greedy tokens (the window applied to those masks too)
    dec = SpeculativeDecoder(target, None)
    text = " ".join(f"Item {i} is {['red', 'green', 'blue', 'odd'][i % 4]}." for i in range(120))
    ids = dec.encode(text + " Which colour is item 7?")
    assert target.window == 512 and len(ids) > 512 + 64
    t = torch.tensor([ids])
    hf = target.model.generate(t, attention_mask=torch.ones_like(t), max_new_tokens=16, do_sample=False,
                               eos_token_id=target.eos_ids)[0, len(ids):].tolist()
    assert dec.generate(ids, 16, speculative=False).token_ids == hf
    assert dec.generate(ids, 16, prompt_lookup_num_tokens=5).token_ids == hf
