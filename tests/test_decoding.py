"""Chain decoding on tiny random Llamas: lossless against plain greedy, exact acceptance on oracle drafts."""

import pytest
import torch
from tiny import tiny_head, tiny_target

from infer import SpeculativeDecoder
from infer import tree
from infer.cache import TargetCache
from infer.proposer import Draft, LookupProposer

PROMPT = [5, 6, 7, 8, 9, 10, 11]


class OracleProposer:
    """Drafts the true greedy continuation, with a wrong token planted at draft position `wrong_at` (0-based)."""

    def __init__(self, truth: list[int], wrong_at: int | None, vocab: int):
        self.truth, self.wrong_at, self.vocab = truth, wrong_at, vocab

    def reset(self, prompt_ids=None):
        self.length = 0

    def rollback(self, n):
        self.length = n

    def propose(self, feats, tokens, cfg, generator=None):
        k = cfg.num_speculative_tokens
        self.length += tokens.shape[1]
        # pairs cover tokens up to index `length` (the root); drafts continue after it
        drafts = list(self.truth[self.length + 1: self.length + 1 + k])
        drafts += [0] * (k - len(drafts))
        if self.wrong_at is not None and self.wrong_at < k:
            drafts[self.wrong_at] = (drafts[self.wrong_at] + 1) % self.vocab
        return Draft.chain(tokens[0, -1], torch.tensor(drafts))


@pytest.fixture(scope="module")
def target():
    return tiny_target()


@pytest.fixture(scope="module")
def baseline(target):
    return SpeculativeDecoder(target, None).generate(PROMPT, 48, speculative=False)


def test_baseline_matches_transformers_generate(target, baseline):
    ids = torch.tensor([PROMPT])
    hf = target.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=48, do_sample=False,
                               pad_token_id=target.tokenizer.pad_token_id)[0, len(PROMPT):].tolist()
    assert baseline.token_ids == hf[: len(baseline.token_ids)]


@pytest.mark.parametrize("k", [1, 2, 3, 5, 8])
def test_random_head_chain_is_lossless(target, baseline, k):
    dec = SpeculativeDecoder(target, tiny_head(target))
    out = dec.generate(PROMPT, 48, num_speculative_tokens=k)
    assert out.token_ids == baseline.token_ids
    assert all(0 <= a <= k for a in out.accept_lengths)


@pytest.mark.parametrize("k", [1, 3, 6])
@pytest.mark.parametrize("wrong_at", [None, 0, 1, 2])
def test_oracle_drafts_accepted_exactly(target, baseline, k, wrong_at):
    truth = PROMPT + baseline.token_ids
    dec = SpeculativeDecoder(target, None, proposer=OracleProposer(truth, wrong_at, target.vocab_size))
    out = dec.generate(PROMPT, 40, num_speculative_tokens=k)
    assert out.token_ids == baseline.token_ids[:40]
    expected = k if wrong_at is None or wrong_at >= k else wrong_at
    assert out.accept_lengths[:-1] == [expected] * (len(out.accept_lengths) - 1)
    assert out.tau == pytest.approx((sum(out.accept_lengths) + out.rounds) / out.rounds)


def test_eos_stops_and_nothing_after(target, baseline):
    eos = baseline.token_ids[9]  # pretend the 10th greedy token is the stop token
    target.config.eos_token_id = eos
    try:
        truth = PROMPT + baseline.token_ids
        dec = SpeculativeDecoder(target, None, proposer=OracleProposer(truth, None, target.vocab_size))
        out = dec.generate(PROMPT, 40, num_speculative_tokens=6)
        first = baseline.token_ids.index(eos)
        assert out.token_ids == baseline.token_ids[: first + 1] and out.stop_reason == "eos"
    finally:
        target.config.eos_token_id = target.tokenizer.eos_token_id


def test_max_new_tokens_exact(target, baseline):
    truth = PROMPT + baseline.token_ids
    dec = SpeculativeDecoder(target, None, proposer=OracleProposer(truth, None, target.vocab_size))
    out = dec.generate(PROMPT, 13, num_speculative_tokens=5)
    assert out.token_ids == baseline.token_ids[:13] and out.stop_reason == "max_new_tokens"


def test_stream_yields_what_generate_returns(target, baseline):
    dec = SpeculativeDecoder(target, tiny_head(target))
    chunks = list(dec.stream(PROMPT, 20, num_speculative_tokens=3))
    assert sum(chunks, []) == baseline.token_ids[:20]


def _in_turns(*streams):
    """Take one round from each unfinished stream in turn; their GenerateOutputs."""
    done = {}
    while len(done) < len(streams):
        for i, s in enumerate(streams):
            if i not in done:
                try:
                    next(s)
                except StopIteration as stop:
                    done[i] = stop.value
    return [done[i] for i in range(len(streams))]


def test_streams_of_one_decoder_taken_in_turns_draft_as_if_alone(target, baseline):
    truth = PROMPT + baseline.token_ids
    for proposer in (OracleProposer(truth, None, target.vocab_size),  # also inside a lookup proposer given as such
                     LookupProposer(OracleProposer(truth, None, target.vocab_size))):
        dec = SpeculativeDecoder(target, None, proposer=proposer)
        for out in _in_turns(*(dec.stream(PROMPT, 40, num_speculative_tokens=3) for _ in range(2))):
            assert out.token_ids == baseline.token_ids[:40]
            assert out.accept_lengths[:-1] == [3] * (len(out.accept_lengths) - 1)  # a shared oracle loses count
    dec = SpeculativeDecoder(target, tiny_head(target))
    other = [9, 8, 7, 6, 5]
    alone = [dec.generate(p, 30, num_speculative_tokens=2, prompt_lookup_num_tokens=2) for p in (PROMPT, other)]
    turns = _in_turns(*(dec.stream(p, 30, num_speculative_tokens=2, prompt_lookup_num_tokens=2)
                        for p in (PROMPT, other)))
    for a, b in zip(alone, turns):
        assert (b.token_ids, b.accept_lengths) == (a.token_ids, a.accept_lengths)


def test_cache_compact_then_step_equals_fresh_forward(target):
    """Keep a non-contiguous subset of appended positions; the next step must match a fresh forward."""
    torch.manual_seed(0)
    seq = torch.randint(4, 90, (1, 12))
    keep = torch.tensor([0, 2, 3])  # offsets among the last 5 positions
    cache = TargetCache()
    target.features(seq[:, :7], position_ids=torch.arange(7)[None], cache=cache.hf)
    # append 5 nodes as a tree where 2 hangs off 0 and 3 off 2: positions follow depth
    parents = torch.tensor([-1, 0, 0, 2, 1])
    nm, d = tree.ancestor_mask(parents), tree.depths(parents)
    from infer.decoder import verify_mask
    target.features(seq[:, 7:12], position_ids=(7 + d)[None], attention_mask=verify_mask(7, nm, torch.float64),
                    cache=cache.hf)
    cache.compact(7, keep)
    assert len(cache) == 10
    kept = torch.cat([seq[:, :7], seq[:, 7:12][:, keep]], dim=1)
    nxt = torch.tensor([[42]])
    step = target.features(nxt, position_ids=torch.tensor([[10]]), cache=cache.hf)
    fresh = target.features(torch.cat([kept, nxt], dim=1))
    torch.testing.assert_close(step[0, -1], fresh[0, -1])


def test_compact_in_one_c_call_moves_what_the_torch_path_moves():
    # float32 buffers on the CPU: compact moves every layer's accepted rows in one C call (kernels.kv_compact),
    # the same values as the index_select path, and the next step still matches a fresh forward
    import cpu_backend
    from cpu_backend import kernels
    from infer.decoder import verify_mask

    if not kernels.available():
        pytest.skip("no C kernel here")
    target = tiny_target(dtype=torch.float32)
    seq = torch.randint(4, 90, (1, 13), generator=torch.Generator().manual_seed(0))
    parents = torch.tensor([-1, 0, 0, 2, 1, 3])
    nm, d = tree.ancestor_mask(parents), tree.depths(parents)
    caches = []
    for table in (True, False):
        cache = TargetCache(move=cpu_backend.compact_kv if table else None)
        cache.reserve(target, 16)
        target.features(seq[:, :7], position_ids=torch.arange(7)[None], cache=cache.hf)
        target.features(seq[:, 7:13], position_ids=(7 + d)[None], attention_mask=verify_mask(7, nm, torch.float32),
                        cache=cache.hf)
        if table:
            table = cpu_backend._buffer_table(cache.hf.layers)
            assert table is not None and table.shape == (2 * len(cache.hf.layers), 5)
        cache.compact(7, torch.tensor([0, 2, 3, 5]))
        caches.append(cache)
    for a, b in zip(*(c.hf.layers for c in caches)):
        assert a.length == b.length == 11 and torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)
    kept = torch.cat([seq[:, :7], seq[:, 7:13][:, [0, 2, 3, 5]]], dim=1)
    step = target.features(seq[:, :1], position_ids=torch.tensor([[11]]), cache=caches[0].hf)
    torch.testing.assert_close(step[0, -1], target.features(torch.cat([kept, seq[:, :1]], dim=1))[0, -1])


def test_preallocated_cache_layers_view_their_buffers_and_take_assigned_tensors():
    # keys / values are views of the first `length` positions of the buffers, made when read: a crop moves only the
    # length and keeps the buffers; a tensor assigned by transformers' own code paths replaces them, and the next
    # update copies it into new buffers
    from eagle.target import PreallocatedLayer

    cache = TargetCache()
    layer = PreallocatedLayer()
    cache.hf.layers.append(layer)
    k, v = torch.randn(1, 2, 5, 4), torch.randn(1, 2, 5, 4)
    layer.update(k, v)
    buf = layer._k
    assert layer.length == 5 and buf.shape[2] >= 5 and torch.equal(layer.keys, k) and torch.equal(layer.values, v)
    assert layer.keys.data_ptr() == buf.data_ptr() and len(cache) == 5
    cache.crop(3)
    assert layer._k is buf and layer.get_seq_length() == 3 and torch.equal(layer.values, v[:, :, :3])
    k2, v2 = torch.randn(1, 2, 2, 4), torch.randn(1, 2, 2, 4)
    keys, values = layer.update(k2, v2)
    assert layer._k is buf and torch.equal(keys, torch.cat([k[:, :, :3], k2], 2))
    assert torch.equal(values, torch.cat([v[:, :, :3], v2], 2))
    layer.crop(-1)  # transformers' own crop assigns shorter tensors
    assert layer._k is None and layer.get_seq_length() == 4 and torch.equal(layer.values, values[:, :, :4])
    layer.update(k2[:, :, :1], v2[:, :, :1])
    assert layer._k is not None and torch.equal(layer.keys, torch.cat([keys[:, :, :4], k2[:, :, :1]], 2))


def test_tree_helpers_hand_drawn():
    parents = torch.tensor([-1, 0, 0, 1, 1, 2, 3])
    assert tree.depths(parents).tolist() == [0, 1, 1, 2, 2, 2, 3]
    assert tree.path_to(tree.ancestor_mask(parents), 6).tolist() == [0, 1, 3, 6]
    m = tree.ancestor_mask(parents)
    assert m[5].nonzero().flatten().tolist() == [0, 2, 5]
    c = tree.ancestor_mask(tree.chain(4))
    assert torch.equal(c, torch.ones(5, 5, dtype=torch.bool).tril())
    p, r = tree.from_choices([[0], [1], [0, 0], [0, 1], [1, 0]])
    assert p.tolist() == [-1, 0, 0, 1, 1, 2] and r.tolist() == [0, 0, 1, 0, 1, 0]


def test_a_long_prompt_is_read_in_chunks_with_the_fast_path():
    # with the fast path, a prompt goes in as chunks of up to 64 tokens into a cache with its buffers made first
    # (the all-layer C call takes each): the same features as one pass over it, to float32 accuracy, and decoding
    # stays lossless
    target = tiny_target(dtype=torch.float32, hidden=64)
    dec = SpeculativeDecoder(target, tiny_head(target))
    dec.use_fast_path(True)
    ids = torch.randint(4, 90, (1, 150), generator=torch.Generator().manual_seed(3))
    rows, hidden = [], target.hidden
    target.hidden = lambda x, *a, **k: rows.append(x.shape[1]) or hidden(x, *a, **k)
    try:
        with torch.inference_mode():
            feats, aux = dec._prefill(ids, TargetCache(), None)
    finally:
        del target.hidden
    assert rows == [64, 64, 22] and aux is None
    with torch.inference_mode():
        torch.testing.assert_close(feats, target.features(ids), rtol=1e-4, atol=1e-4)
    greedy = dec.generate(ids[0].tolist(), 16, speculative=False)
    assert dec.generate(ids[0].tolist(), 16, num_speculative_tokens=3).token_ids == greedy.token_ids
    dec.use_fast_path(False)
