"""Prompt lookup drafts (n-gram), alone and merged into an EAGLE head's tree: the index, the merge, losslessness,
and exact acceptance against a brute-force reference of what the lookup drafts."""

import pytest
import torch
from tiny import tiny_head, tiny_target

from infer import DecodeConfig, SpeculativeDecoder
from infer.proposer import Draft, LookupProposer, NgramIndex, merge_chain

PROMPT = [5, 6, 7, 8, 5, 6, 7, 9, 5, 6, 7, 8, 10]  # repeats, so the lookup finds matches from the first round


def reference_draft(text: list[int], m: int, min_n: int, max_n: int) -> list[int]:
    """Brute force: scan back for the latest earlier occurrence of the longest suffix, continue m tokens from it,
    running on into the draft where the text ends."""
    L = len(text)
    for n in range(min(max_n, L), min_n - 1, -1):
        for s in range(L - n - 1, -1, -1):
            if text[s:s + n] == text[L - n:]:
                out = []
                for j in range(m):
                    out.append(text[s + n + j] if s + n + j < L else out[s + n + j - L])
                return out
    return []


def test_ngram_index_hand_checked():
    idx = NgramIndex(2, 3)
    idx.extend([1, 2, 3, 4, 1, 2, 3])
    assert idx.draft(3) == [4, 1, 2]  # "1 2 3" occurred before, followed by 4 1 2
    idx.extend([9, 2, 3])
    assert idx.draft(2) == [9, 2]  # the latest "2 3" (n = 2: "9 2 3" has no earlier occurrence) is followed by 9
    loop = NgramIndex(1, 3)
    loop.extend([7, 7, 7])
    assert loop.draft(5) == [7, 7, 7, 7, 7]  # a loop shorter than the draft runs on into the draft
    none = NgramIndex(3, 3)
    none.extend([1, 2, 3, 4])
    assert none.draft(4) == []


def test_ngram_index_agrees_with_brute_force():
    g = torch.Generator().manual_seed(0)
    for trial in range(200):
        text = torch.randint(0, 4, (int(torch.randint(1, 40, (1,), generator=g)),), generator=g).tolist()
        min_n = 1 + trial % 3
        max_n = min_n + trial % 2
        idx = NgramIndex(min_n, max_n)
        cut = len(text) // 2
        idx.extend(text[:cut])  # in two parts, as rounds extend it
        idx.extend(text[cut:])
        assert idx.draft(5) == reference_draft(text, 5, min_n, max_n), (text, min_n, max_n)


def test_ngram_index_after_drafted_tokens_agrees_with_brute_force():
    # a lookup of the text followed by drafted tokens: the latest occurrence of the longest suffix that lies whole in
    # the committed text with a committed token after it, continued through the drafted tokens where it runs on
    g = torch.Generator().manual_seed(1)
    for trial in range(200):
        text = torch.randint(0, 4, (int(torch.randint(1, 30, (1,), generator=g)),), generator=g).tolist()
        extra = torch.randint(0, 4, (int(torch.randint(1, 4, (1,), generator=g)),), generator=g).tolist()
        min_n, max_n = 1 + trial % 2, 2 + trial % 3
        idx = NgramIndex(min_n, max_n)
        idx.extend(text)
        seq, want = text + extra, []
        for n in range(min(max_n, len(seq)), min_n - 1, -1):
            starts = [s for s in range(len(text) - n - 1, -1, -1) if seq[s:s + n] == seq[len(seq) - n:]]
            if starts:
                for j in range(5):
                    i = starts[0] + n + j
                    want.append(seq[i] if i < len(seq) else want[i - len(seq)])
                break
        assert idx.draft(5, extra) == want, (text, extra, min_n, max_n)


class _FixedChain:
    """A proposer that always drafts one given token after the root."""

    def __init__(self, token: int):
        self.token = token

    def reset(self, prompt_ids=None):
        pass

    def rollback(self, n):
        pass

    def propose(self, feats, tokens, cfg, generator=None):
        return Draft.chain(tokens[0, -1], torch.tensor([self.token]))


def test_lookup_after_drafts_continues_the_head_leaf_hand_checked():
    from infer.decoder import DecodeConfig
    from infer.proposer import LookupProposer

    text = [2, 9, 7, 1, 2, 3, 4, 1, 2]  # the root is the last 2
    cfg = DecodeConfig(prompt_lookup_num_tokens=3, prompt_lookup_min=2, prompt_lookup_max=3)
    plain = LookupProposer(_FixedChain(9)).propose(None, torch.tensor([text]), cfg)
    assert plain.tokens.tolist() == [2, 9, 3, 4, 1]  # root -> 9 (the head), root -> 3 4 1 ("1 2" last at 3)
    after = LookupProposer(_FixedChain(9)).propose(None, torch.tensor([text]), DecodeConfig(
        prompt_lookup_num_tokens=3, prompt_lookup_min=2, prompt_lookup_max=3, prompt_lookup_after_drafts=True))
    assert after.tokens.tolist() == [2, 9, 3, 4, 1, 7, 1, 2]  # and 9 -> 7 1 2 ("2 9" at 0)
    assert after.parents.tolist() == [-1, 0, 0, 2, 3, 1, 5, 6]
    assert after.lookup.tolist() == [False, False, True, True, True, True, True, True]
    assert after.drafted.tolist() == [True, True] + [False] * 6


@pytest.mark.parametrize("cfg", [dict(num_speculative_tokens=2), dict(mode="dynamic", top_k=2, depth=3,
                                                                      total_tokens=5)])
def test_lookup_after_drafts_is_lossless(target, baseline, cfg):
    dec = SpeculativeDecoder(target, tiny_head(target))
    out = dec.generate(PROMPT, 48, prompt_lookup_num_tokens=4, prompt_lookup_min=1, prompt_lookup_max=3,
                       prompt_lookup_after_drafts=True, **cfg)
    assert out.token_ids == baseline.token_ids


def test_merge_chain_shares_the_prefix_it_agrees_with():
    d = Draft(torch.tensor([10, 11, 12, 13]), torch.tensor([-1, 0, 1, 0]))  # root 10 -> 11 -> 12, and 10 -> 13
    m = merge_chain(d, [11, 14, 15])
    assert m.tokens.tolist() == [10, 11, 12, 13, 14, 15]
    assert m.parents.tolist() == [-1, 0, 1, 0, 1, 4]
    assert m.depth.tolist() == [0, 1, 2, 1, 2, 3]
    assert m.lookup.tolist() == [False, True, False, False, True, True]  # the chain's nodes, the shared one too
    assert m.drafted.tolist() == [True] * 4 + [False] * 2
    same = merge_chain(d, [13])
    assert same.parents is d.parents and same.lookup.tolist() == [False, False, False, True]
    assert not merge_chain(d, []).lookup.any()
    q = torch.rand(4, 20)
    mq = merge_chain(Draft(d.tokens, d.parents, q), [11, 14, 15])
    assert mq.q.shape == (6, 20) and torch.equal(mq.q[:4], q) and not mq.q[4:].any()
    # with a dict of shapes: the same drafts, and a second draft of the same shape reuses the first one's tensors
    shapes = {}
    a = merge_chain(d, [11, 14, 15], shapes=shapes)
    b = merge_chain(Draft(torch.tensor([20, 21, 22, 23]), d.parents), [21, 24, 25], shapes=shapes)
    for x in (a, b):
        assert torch.equal(x.parents, m.parents) and torch.equal(x.node_mask, m.node_mask)
        assert torch.equal(x.depth, m.depth) and torch.equal(x.lookup, m.lookup) and torch.equal(x.drafted, m.drafted)
    assert b.tokens.tolist() == [20, 21, 22, 23, 24, 25] and b.parents is a.parents and len(shapes) == 1


@pytest.fixture(scope="module")
def target():
    return tiny_target()


@pytest.fixture(scope="module")
def baseline(target):
    return SpeculativeDecoder(target, None).generate(PROMPT, 48, speculative=False)


def replay(text_before: list[int], generated: list[int], accept_lengths: list[int]):
    """(committed text, next tokens) at the start of every round: the lookup sees the prompt after its first token."""
    done = 1  # the prefill emits the first token
    for a in accept_lengths:
        yield text_before + generated[:done], generated[done:]
        done += a + 1


def agreed(draft: list[int], future: list[int]) -> int:
    """How many leading draft tokens the target's own continuation confirms."""
    n = 0
    while n < min(len(draft), len(future)) and draft[n] == future[n]:
        n += 1
    return n


@pytest.mark.parametrize("m,min_n,max_n", [(3, 1, 3), (5, 2, 2), (4, 3, 3)])
def test_lookup_alone_is_lossless_and_accepts_exactly_its_matching_prefix(target, baseline, m, min_n, max_n):
    dec = SpeculativeDecoder(target, None)
    out = dec.generate(PROMPT, 48, prompt_lookup_num_tokens=m, prompt_lookup_min=min_n, prompt_lookup_max=max_n)
    assert out.token_ids == baseline.token_ids
    expected = [agreed(reference_draft(text, m, min_n, max_n), future)
                for text, future in replay(PROMPT[1:], out.token_ids, out.accept_lengths)]
    assert out.accept_lengths[:-1] == expected[:-1]  # the last round may be cut by max_new_tokens
    if min_n == 1:
        assert sum(out.accept_lengths) > 0  # the check above is not vacuous here


@pytest.mark.parametrize("cfg", [dict(num_speculative_tokens=2), dict(mode="dynamic", top_k=2, depth=3,
                                                                      total_tokens=5)])
def test_lookup_merged_into_the_head_tree_is_lossless_and_never_accepts_less(target, baseline, cfg):
    dec = SpeculativeDecoder(target, tiny_head(target))
    out = dec.generate(PROMPT, 48, prompt_lookup_num_tokens=4, prompt_lookup_min=1, prompt_lookup_max=3, **cfg)
    assert out.token_ids == baseline.token_ids
    for (text, future), a in zip(replay(PROMPT[1:], out.token_ids, out.accept_lengths[:-1]), out.accept_lengths):
        assert a >= agreed(reference_draft(text, 4, 1, 3), future)


@pytest.mark.parametrize("m,min_n,max_n", [(5, 1, 3), (4, 2, 2)])
def test_adaptive_lookup_alone_follows_the_heuristic_schedule_exactly(target, baseline, m, min_n, max_n):
    # transformers' "heuristic" schedule: from m, +2 after a round that took the whole lookup, -1 after one that did
    # not, within 1 .. m; rounds without a lookup leave it as it is
    dec = SpeculativeDecoder(target, None)
    out = dec.generate(PROMPT, 48, prompt_lookup_num_tokens=m, prompt_lookup_min=min_n, prompt_lookup_max=max_n,
                       prompt_lookup_adaptive=True)
    assert out.token_ids == baseline.token_ids
    n, expected, lengths = m, [], []
    for text, future in replay(PROMPT[1:], out.token_ids, out.accept_lengths):
        draft = reference_draft(text, n, min_n, max_n)
        expected.append(agreed(draft, future))
        lengths.append(len(draft))
        if draft:
            n = min(m, n + 2) if expected[-1] == len(draft) else max(1, n - 1)
    assert out.accept_lengths[:-1] == expected[:-1]
    assert len(set(lengths) - {0}) > 1  # the length did change: the check above is not vacuous


def test_adaptive_length_counts_a_lookup_after_the_drafts_taken_whole_hand_checked():
    class Sevens:  # an inner proposer that always drafts the one token 7
        def propose(self, feats, tokens, cfg, generator=None):
            return Draft.chain(tokens[0, -1], torch.tensor([7]))

    cfg = DecodeConfig(prompt_lookup_num_tokens=3, prompt_lookup_min=1, prompt_lookup_max=1,
                       prompt_lookup_adaptive=True, prompt_lookup_after_drafts=True)
    q, lengths = LookupProposer(Sevens()), []
    # round 0 (the prompt after its first token, then the root 1): the root's lookup after "1" is 2 3 7, the one
    # after the drafted 7 is 4 5 6; round 1 took neither (root 5): 2 tokens now, lookups 6 8 and, after 7, 4 5;
    # round 2 took 7 4 5 whole (root 2): back to 3, where only the root's lookup counted it would drop to 1
    for committed in ([1, 2, 3, 7, 4, 5, 6, 8, 1], [5], [7, 4, 5, 2]):
        draft = q.propose(None, torch.tensor([committed]), cfg)
        lengths.append(q.length)
    assert lengths == [3, 2, 3]
    assert draft.tokens.tolist()[:1] == [2]


@pytest.mark.parametrize("cfg", [dict(num_speculative_tokens=2), dict(mode="dynamic", top_k=2, depth=3,
                                                                      total_tokens=5),
                                 dict(num_speculative_tokens=2, temperature=0.0, prompt_lookup_after_drafts=True)])
def test_adaptive_lookup_merged_into_the_head_tree_is_lossless(target, baseline, cfg):
    dec = SpeculativeDecoder(target, tiny_head(target))
    out = dec.generate(PROMPT, 48, prompt_lookup_num_tokens=4, prompt_lookup_min=1, prompt_lookup_max=3,
                       prompt_lookup_adaptive=True, **cfg)
    assert out.token_ids == baseline.token_ids


def test_bad_lookup_settings_are_one_line_errors(target):
    dec = SpeculativeDecoder(target, tiny_head(target))
    with pytest.raises(ValueError, match="prompt_lookup_min <= prompt_lookup_max") as e:
        dec.generate(PROMPT, 4, prompt_lookup_num_tokens=3, prompt_lookup_min=5)
    assert "\n" not in str(e.value)
    with pytest.raises(ValueError, match="prompt_lookup_adaptive needs prompt_lookup_num_tokens > 0") as e:
        dec.generate(PROMPT, 4, prompt_lookup_adaptive=True)
    assert "\n" not in str(e.value)


def test_lookup_alone_sampling_reproduces_the_target_distribution():
    from test_trees import _tv_test  # the exact distribution of the first two tokens, against 600 draws

    target = tiny_target(vocab_size=24, seed=3)
    target.model.lm_head.weight.mul_(0.15)
    dec = SpeculativeDecoder(target, None)
    # min 1: the first sampled token drafts whatever followed it in the prompt, when it occurs there
    tv, noise = _tv_test(target, dec, dict(prompt_lookup_num_tokens=2, prompt_lookup_min=1, temperature=1.0),
                         trials=600)
    assert tv < 1.5 * noise + 0.01, (tv, noise)


@pytest.mark.parametrize("cfg", [
    dict(mode="chain", num_speculative_tokens=2, temperature=1.0),
    dict(mode="static", tree="[[0], [1], [0, 0]]", temperature=0.8, top_p=0.9),
    dict(mode="dynamic", top_k=3, depth=2, total_tokens=5, temperature=1.2),
])
def test_lookup_merged_into_the_head_tree_sampling_reproduces_the_target_distribution(cfg):
    """Lookup nodes are point masses tried before the head's drawn siblings (some of them the same node)."""
    from test_trees import _tv_test

    target = tiny_target(vocab_size=24, seed=3)
    target.model.lm_head.weight.mul_(0.15)
    dec = SpeculativeDecoder(target, tiny_head(target, seed=4))
    tv, noise = _tv_test(target, dec, dict(cfg, prompt_lookup_num_tokens=2, prompt_lookup_min=1), trials=600)
    assert tv < 1.5 * noise + 0.01, (tv, noise)


def test_accept_sampled_with_a_lookup_child_matches_p_exactly():
    """One round on a 3-token vocabulary, every draw of the head's child enumerated: a lookup child (token 2, which
    q rarely draws; the same node when it does) tried first as a point mass, then the head's child drawn from q.
    Taking the lookup child for a draw from q would emit token 2 with probability 0.82."""
    from infer.sampling import accept_sampled

    p_root, q_root = torch.tensor([0.1, 0.6, 0.3]), torch.tensor([0.9, 0.08, 0.02])
    g = torch.Generator().manual_seed(0)
    law = torch.zeros(3)
    for a in range(3):  # the head's one child, drawn from q
        if a == 2:  # shared with the lookup
            tokens, parents, lookup, drafted = [9, 2], [-1, 0], [False, True], [True, True]
        else:
            tokens, parents, lookup, drafted = [9, a, 2], [-1, 0, 0], [False, False, True], [True, True, False]
        n = len(tokens)
        p = torch.cat([p_root[None], torch.eye(3)[: n - 1]])
        q = torch.cat([q_root[None], torch.zeros(n - 1, 3)])
        hits = torch.zeros(3)
        for _ in range(6000):
            best, nxt = accept_sampled(torch.tensor(tokens), torch.tensor(parents), p, q, g, torch.tensor(lookup),
                                       torch.tensor(drafted))
            hits[tokens[best] if best else nxt] += 1
        law += q_root[a] * hits / hits.sum()
    torch.testing.assert_close(law, p_root, atol=0.02, rtol=0)


def test_eval_with_prompt_lookup_and_no_head(tmp_path):
    import json

    from eagle_cli import _config_from_args, build_parser
    from infer.evaluate import EvalConfig, evaluate

    args = build_parser().parse_args(["eval", "--data", str(tmp_path / "p.jsonl"), "--out", str(tmp_path / "ev"),
                                      "--num-prompts", "2", "--max-new-tokens", "16", "--num-speculative-tokens",
                                      "2", "--prompt-lookup-num-tokens", "5", "--prompt-lookup-min", "1"])
    cfg = _config_from_args(EvalConfig, args)
    assert (cfg.decode.prompt_lookup_num_tokens, cfg.decode.prompt_lookup_min) == (5, 1) and not cfg.draft
    (tmp_path / "p.jsonl").write_text(json.dumps({"turns": ["w1 w2 w1 w2 w1"]}) + "\n" + json.dumps({"turns": ["w4"]}))
    r = evaluate(cfg, decoder=SpeculativeDecoder(tiny_target(), None))
    assert r["lossless"] == 1.0 and len(r["acceptance_per_position"]) == 5
