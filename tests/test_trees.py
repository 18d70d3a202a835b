"""Static and dynamic draft trees, lossless sampling, stop strings (tiny float64 Llamas, random heads)."""

import copy
import math

import pytest
import torch
from tiny import tiny_head, tiny_target

from infer import SpeculativeDecoder, tree
from infer.cache import TargetCache
from infer.decoder import DecodeConfig, verify_mask
from infer.proposer import Draft, EagleProposer
from infer.sampling import accept_sampled, process

PROMPT = [5, 9, 14, 22, 7, 31, 3]
STATIC = "[[0], [1], [2], [0, 0], [0, 1], [1, 0], [0, 0, 0], [0, 0, 1], [0, 1, 0]]"


@pytest.fixture(scope="module")
def target():
    return tiny_target()


@pytest.fixture(scope="module")
def baseline(target):
    return SpeculativeDecoder(target, None).generate(PROMPT, 48, speculative=False)


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_node_logits_under_tree_mask_equal_a_plain_forward_over_its_path(attn):
    target = tiny_target(attn=attn)
    g = torch.Generator().manual_seed(0)
    prefix = torch.randint(4, 90, (1, 6), generator=g)
    parents = torch.tensor([-1, 0, 0, 1, 1, 2, 3, 5])
    nodes = torch.randint(4, 90, (1, parents.shape[0]), generator=g)
    nm, d = tree.ancestor_mask(parents), tree.depths(parents)
    cache = TargetCache()
    target.features(prefix, position_ids=torch.arange(6)[None], cache=cache.hf)
    feats = target.features(nodes, position_ids=(6 + d)[None], attention_mask=verify_mask(6, nm, torch.float64),
                            cache=cache.hf)
    for n in range(parents.shape[0]):
        path = tree.path_to(nm, n)
        plain = target.features(torch.cat([prefix, nodes[:, path]], dim=1))
        # eager attention takes its softmax in float32, hence the float32-sized tolerance
        torch.testing.assert_close(target.logits(feats[0, n]), target.logits(plain[0, -1]), rtol=1e-5, atol=1e-5)


def _reference_head_logits(proposer, feats, tokens, path_tokens):
    """The head's logits after a root-to-node path, computed one token at a time on a private cache copy."""
    head, ref = proposer.head, copy.deepcopy(proposer.cache)
    start = ref.length
    h = head(feats, tokens, torch.arange(start, start + tokens.shape[1])[None], cache=ref)[:, -1:]
    for tok in path_tokens:
        h = head(h, torch.tensor([[tok]]), torch.tensor([[ref.length]]), cache=ref)
    return head.logits(h)[0, -1]


@pytest.mark.parametrize("mode", ["static", "dynamic"])
def test_every_drafted_node_is_what_the_head_predicts_along_its_path(target, mode):
    head = tiny_head(target)
    proposer = EagleProposer(head)
    g = torch.Generator().manual_seed(1)
    feats = torch.randn(1, 6, target.hidden_size, generator=g, dtype=torch.float64)
    tokens = torch.randint(4, 90, (1, 6), generator=g)
    cfg = DecodeConfig(mode=mode, tree=STATIC, top_k=3, depth=4, total_tokens=12)
    before = copy.deepcopy(proposer)
    draft = proposer.propose(feats, tokens, cfg)
    nm = tree.ancestor_mask(draft.parents)
    _, ranks = tree.from_choices(eval(STATIC))
    assert draft.tokens[0] == tokens[0, -1]
    if mode == "dynamic":
        assert draft.parents.shape[0] == 12 and int(tree.depths(draft.parents).max()) <= 4
    for n in range(1, draft.parents.shape[0]):
        path = tree.path_to(nm, n)
        logits = _reference_head_logits(before, feats, tokens, draft.tokens[path[1:-1]].tolist())
        order = logits.argsort(descending=True)
        if mode == "static":
            assert draft.tokens[n] == order[ranks[n]]
        else:
            assert draft.tokens[n] in order[: cfg.top_k]
        siblings = draft.tokens[draft.parents == draft.parents[n]]
        assert siblings.unique().shape == siblings.shape  # no duplicate children


@pytest.mark.parametrize("cfg", [
    dict(mode="static", tree=STATIC),
    dict(mode="static", tree="[[0], [0, 0], [0, 0, 0]]"),
    dict(mode="dynamic", top_k=1, depth=3, total_tokens=4),
    dict(mode="dynamic", top_k=2, depth=3, total_tokens=6),
    dict(mode="dynamic", top_k=4, depth=5, total_tokens=16),
])
def test_greedy_tree_decoding_equals_plain_greedy(target, baseline, cfg):
    dec = SpeculativeDecoder(target, tiny_head(target))
    out = dec.generate(PROMPT, 48, **cfg)
    assert out.token_ids == baseline.token_ids
    assert out.tau >= 1.0


def test_top1_dynamic_tree_and_chain_draft_the_same_tokens(target):
    head = tiny_head(target)
    g = torch.Generator().manual_seed(2)
    feats = torch.randn(1, 5, target.hidden_size, generator=g, dtype=torch.float64)
    tokens = torch.randint(4, 90, (1, 5), generator=g)
    a = EagleProposer(head).propose(feats, tokens, DecodeConfig(num_speculative_tokens=4))
    b = EagleProposer(head).propose(feats, tokens, DecodeConfig(mode="dynamic", top_k=1, depth=4, total_tokens=5))
    c = EagleProposer(head).propose(feats, tokens, DecodeConfig(mode="static", tree="[[0], [0, 0], [0, 0, 0], [0, 0, 0, 0]]"))
    assert torch.equal(a.tokens, b.tokens) and torch.equal(a.tokens, c.tokens)
    assert torch.equal(a.parents, b.parents) and torch.equal(a.parents, c.parents)


class OracleTreeProposer:
    """A tree of distractor branches with the true continuation planted on one branch, correct to `good` levels."""

    def __init__(self, truth: list[int], good: int, vocab: int):
        self.truth, self.good, self.vocab = truth, good, vocab

    def reset(self, prompt_ids=None):
        self.length = 0

    def rollback(self, n):
        self.length = n

    def propose(self, feats, tokens, cfg, generator=None):
        self.length += tokens.shape[1]
        nxt = self.truth[self.length + 1: self.length + 5] + [0] * 4
        wrong = [(t + 1) % self.vocab for t in nxt]
        # root -> a (wrong), b (true branch); b -> c (wrong), d; d -> e; a -> f
        true_path = [nxt[i] if i < self.good else wrong[i] for i in range(3)]
        toks = [tokens[0, -1].item(), wrong[0], true_path[0], wrong[1] if self.good >= 2 else (wrong[1] + 1) % self.vocab,
                true_path[1], true_path[2], nxt[1]]
        parents = torch.tensor([-1, 0, 0, 2, 2, 4, 1])
        return Draft(torch.tensor(toks), parents)


@pytest.mark.parametrize("good", [0, 1, 2, 3])
def test_oracle_tree_accepted_to_the_exact_depth(target, baseline, good):
    dec = SpeculativeDecoder(target, None)
    dec.proposer = OracleTreeProposer(PROMPT + baseline.token_ids, good, target.vocab_size)
    out = dec.generate(PROMPT, 40, mode="static", tree="[[0]]")  # the oracle draws its own tree
    assert out.token_ids == baseline.token_ids[:40]
    assert out.accept_lengths[:-1] == [good] * (len(out.accept_lengths) - 1)


def _exact_pair_distribution(target, prompt, cfg):
    """p(x1, x2) of the first two sampled tokens, enumerated exactly; [V, V]."""
    with torch.no_grad():
        ids = torch.tensor([prompt])
        p1 = process(target.logits(target.features(ids)[0, -1])[None], cfg["temperature"],
                     cfg.get("sampling_top_k", 0), cfg.get("top_p", 1.0))[0]
        V = p1.shape[0]
        both = torch.cat([ids.repeat(V, 1), torch.arange(V)[:, None]], dim=1)
        p2 = process(target.logits(target.features(both)[:, -1]), cfg["temperature"], cfg.get("sampling_top_k", 0),
                     cfg.get("top_p", 1.0))
    joint = torch.zeros(V, V + 1, dtype=p1.dtype)  # column V: nothing after an EOS first token
    joint[:, :V] = p1[:, None] * p2
    eos = target.eos_ids[0]
    joint[eos, :V], joint[eos, V] = 0.0, p1[eos]
    return joint


SMALL_PROMPT = [5, 9, 14, 2, 7]  # ids of the 24-token vocabulary


def _tv_test(target, dec, cfg, trials):
    exact = _exact_pair_distribution(target, SMALL_PROMPT, cfg)
    counts = torch.zeros_like(exact)
    g = torch.Generator().manual_seed(123)
    for _ in range(trials):
        out = dec.generate(SMALL_PROMPT, 2, generator=g, **cfg)
        first, second = out.token_ids[0], (out.token_ids[1:] or [exact.shape[0]])[0]
        counts[first, second] += 1
    tv = 0.5 * (counts / trials - exact).abs().sum().item()
    # expected TV of an exact sampler with this many trials: 0.5 * sum sqrt(2 p (1 - p) / (pi n))
    noise = 0.5 * (2 * exact * (1 - exact) / (math.pi * trials)).sqrt().sum().item()
    return tv, noise


@pytest.mark.parametrize("cfg", [
    dict(mode="chain", num_speculative_tokens=3, temperature=1.0),
    dict(mode="static", tree="[[0], [1], [2], [0, 0], [1, 0]]", temperature=0.8, top_p=0.9),
    dict(mode="dynamic", top_k=3, depth=3, total_tokens=7, temperature=1.2, sampling_top_k=20),
])
def test_sampling_reproduces_the_target_distribution(cfg):
    target = tiny_target(vocab_size=24, seed=3)
    target.model.lm_head.weight.mul_(0.15)  # undo most of the sharpening: many plausible tokens
    dec = SpeculativeDecoder(target, tiny_head(target, seed=4))
    tv, noise = _tv_test(target, dec, cfg, trials=600)
    assert tv < 1.5 * noise + 0.01, (tv, noise)


def test_accept_sampled_on_a_hand_built_tree_matches_p_exactly():
    """Enumerate every outcome of one round on a 3-token vocabulary: the first emitted token is distributed as p."""
    p_root = torch.tensor([0.5, 0.3, 0.2])
    q_root = torch.tensor([0.2, 0.3, 0.5])
    parents = torch.tensor([-1, 0, 0])
    p = torch.stack([p_root, torch.tensor([1.0, 0, 0]), torch.tensor([0, 1.0, 0])])
    q = torch.stack([q_root, torch.zeros(3), torch.zeros(3)])
    # the first emitted token's law, averaged over the two children drawn without replacement from q
    law = torch.zeros(3)
    g = torch.Generator().manual_seed(0)
    n = 20000
    for a in range(3):
        for b in range(3):
            if a == b:
                continue
            w = q_root[a] * q_root[b] / (1 - q_root[a])
            hits = torch.zeros(3)
            for _ in range(n // 20):
                best, nxt = accept_sampled(torch.tensor([9, a, b]), parents, p, q, g)
                first = a if best == 1 else b if best == 2 else nxt
                hits[first] += 1
            law += w * hits / hits.sum()
    torch.testing.assert_close(law, p_root, atol=0.03, rtol=0)


def test_stop_string_ends_the_output_even_inside_an_accepted_round(target, baseline):
    tok = target.tokenizer
    words = tok.decode(baseline.token_ids[:30], skip_special_tokens=True)
    stop = tok.decode(baseline.token_ids[10:12], skip_special_tokens=True).strip()
    dec = SpeculativeDecoder(target, None)
    from test_decoding import OracleProposer
    dec.proposer = OracleProposer(PROMPT + baseline.token_ids, None, target.vocab_size)
    out = dec.generate(PROMPT, 48, num_speculative_tokens=5, stop=[stop])
    assert out.stop_reason == "stop_string"
    assert stop in out.text
    assert stop not in tok.decode(out.token_ids[:-1], skip_special_tokens=True)  # it ends at the stop
    assert out.token_ids == baseline.token_ids[: len(out.token_ids)]
    assert stop in words and len(out.token_ids) <= 12
    streamed = []
    s = dec.stream(PROMPT, 48, num_speculative_tokens=5, stop=[stop])
    for new in s:
        streamed += new
    assert streamed == out.token_ids


def test_children_beyond_the_support_of_q_are_never_accepted():
    """A static tree may ask for more children than q has tokens; those were not drawn from q and are skipped."""
    p = torch.tensor([[0.5, 0.3, 0.2], [1.0, 0, 0], [0, 1.0, 0]])
    q = torch.tensor([[1.0, 0.0, 0.0], [0, 0, 0], [0, 0, 0]])
    g = torch.Generator().manual_seed(0)
    hits = torch.zeros(3)
    for _ in range(4000):
        best, nxt = accept_sampled(torch.tensor([9, 0, 1]), torch.tensor([-1, 0, 0]), p, q, g)
        assert best != 2
        hits[0 if best == 1 else nxt] += 1
    torch.testing.assert_close(hits / hits.sum(), p[0], atol=0.03, rtol=0)


@pytest.mark.parametrize("bad,msg", [
    (dict(mode="beam"), "mode 'beam'"), (dict(mode="static"), "needs a tree"),
    (dict(mode="dynamic", total_tokens=1), "total_tokens >= 2"), (dict(top_p=0.0), "0 < top_p"),
    (dict(mode="static", tree="[[1, 2"), "not a JSON list"),
])
def test_bad_decoding_settings_are_one_line_errors(target, bad, msg):
    dec = SpeculativeDecoder(target, tiny_head(target))
    with pytest.raises(ValueError, match=msg) as e:
        dec.generate(PROMPT, 4, **bad)
    assert "\n" not in str(e.value)


def test_ancestor_mask_matches_a_walk_up_the_parents_on_random_trees():
    # bit sets up to 63 nodes, rows of a tensor beyond: both are a node's own walk up to the root
    g = torch.Generator().manual_seed(0)
    for n in (1, 2, 5, 17, 63, 64, 90):
        parents = torch.tensor([-1] + [int(torch.randint(0, i, (1,), generator=g)) for i in range(1, n)])
        want = torch.zeros(n, n, dtype=torch.bool)
        for i in range(n):
            j = i
            while j >= 0:
                want[i, j] = True
                j = int(parents[j])
        assert torch.equal(tree.ancestor_mask(parents), want)


def test_accept_greedy_takes_the_first_deepest_node_whose_path_the_target_agrees_with():
    from infer.sampling import accept_greedy

    g = torch.Generator().manual_seed(1)
    for n in (1, 2, 6, 12, 40):
        for _ in range(20):
            parents = torch.tensor([-1] + [int(torch.randint(0, i, (1,), generator=g)) for i in range(1, n)])
            tokens = torch.randint(0, 3, (n,), generator=g)
            predicted = torch.randint(0, 3, (n,), generator=g)
            mask, depth = tree.ancestor_mask(parents), tree.depths(parents)
            ok = [all(j == 0 or int(tokens[j]) == int(predicted[parents[j]]) for j in tree.path_to(mask, i).tolist())
                  for i in range(n)]
            want = max(range(n), key=lambda i: (ok[i], int(depth[i]) if ok[i] else -1, -i))
            assert accept_greedy(tokens, predicted, parents, depth) == want


def test_sample_draws_the_given_distribution_and_never_a_zero():
    # inverse-CDF draws: unnormalized masses, zeros between and at the ends never drawn, frequencies within a few
    # standard errors of the masses over 40,000 seeded draws
    from infer.sampling import sample

    probs = torch.tensor([0.0, 2.0, 0.0, 5.0, 3.0, 0.0])
    g = torch.Generator().manual_seed(0)
    counts = torch.zeros(6)
    for _ in range(40_000):
        counts[sample(probs, g)] += 1
    assert counts[[0, 2, 5]].sum() == 0
    freq, want = counts / counts.sum(), probs / probs.sum()
    assert (freq - want).abs().max() < 4 * (want * (1 - want) / 40_000).sqrt().max()
    assert sample(torch.tensor([0.0, 0.0, 1.0]), g) == 2


def test_top_p_from_the_largest_few_equals_sorting_all():
    # process() finds the nucleus among the 64 or 1,024 largest probabilities where their mass reaches top_p, else
    # sorts all: the same probabilities as sorting all, on peaked, middling and flat rows, one or several at once
    def sort_all(logits, top_p):
        probs = torch.softmax(logits.float() / 0.7, dim=-1)
        sorted_p, order = probs.sort(dim=-1, descending=True)
        probs = probs.scatter(-1, order, sorted_p.masked_fill(sorted_p.cumsum(-1) - sorted_p >= top_p, 0.0))
        return probs / probs.sum(-1, keepdim=True)

    g = torch.Generator().manual_seed(0)
    for scale in (0.3, 3.0, 10.0):  # flat (all sorted), middling (1,024), peaked (64)
        for top_p in (0.5, 0.9, 0.999):
            logits = torch.randn(3, 5000, generator=g) * scale
            assert torch.equal(process(logits, 0.7, 0, top_p), sort_all(logits, top_p))
            assert torch.equal(process(logits[:1], 0.7, 0, top_p), sort_all(logits[:1], top_p))
