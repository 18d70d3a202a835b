"""Speculative sampling over several rounds: the law of the 3rd to 5th sampled tokens, enumerated exactly.

The pair tests elsewhere (`test_trees._tv_test`) look at the first two tokens, which the first round mostly emits.
Here a 10-token vocabulary lets every sequence of five tokens be enumerated, so the tokens that later rounds emit
(after rejections, cache compaction, the head's reused cache, an adaptive lookup length) are checked against the
target's own law too."""

import math

import pytest
import torch
from tiny import tiny_target

from eagle import HeadConfig
from eagle.head import make_head

from infer import SpeculativeDecoder
from infer.sampling import process

V = 10  # tokens 0-9; 3 is the EOS
N = 5  # sampled tokens per trial
PROMPT = [5, 9, 4, 7, 5, 9, 6, 4, 7, 8]  # repeats, so that prompt lookups find something


def exact_law(target, prompt: list[int], cfg: dict, n: int) -> dict[tuple, float]:
    """{sequence of the first n sampled tokens: its probability}; one that stops at an EOS is padded with V."""
    eos = target.eos_ids[0]
    law: dict[tuple, float] = {}
    alive = [((), 1.0)]
    for j in range(n):
        with torch.no_grad():
            ids = torch.tensor([prompt + list(s) for s, _ in alive])
            p = process(target.logits(target.features(ids)[:, -1]), cfg["temperature"], cfg.get("sampling_top_k", 0),
                        cfg.get("top_p", 1.0)).double()
        grown = []
        for (s, w), row in zip(alive, p):
            for t in torch.nonzero(row).flatten().tolist():
                seq, mass = s + (t,), w * row[t].item()
                if t == eos or j == n - 1:
                    seq += (V,) * (n - len(seq))
                    law[seq] = law.get(seq, 0.0) + mass
                else:
                    grown.append((seq, mass))
        alive = grown
    return law


def marginal(law: dict[tuple, float], positions: tuple[int, ...]) -> torch.Tensor:
    out = torch.zeros((V + 1,) * len(positions), dtype=torch.float64)
    for seq, mass in law.items():
        out[tuple(seq[i] for i in positions)] += mass
    return out


def chi2_z(seen: torch.Tensor, expected: torch.Tensor) -> float:
    """Pearson's chi-square of counts against expected counts (cells expected below 5 pooled into one), as a
    standard normal deviate (Wilson-Hilferty): about N(0, 1) for an exact sampler."""
    low = expected < 5
    e = torch.cat([expected[~low], expected[low].sum()[None]])
    o = torch.cat([seen[~low], seen[low].sum()[None]])
    if e[-1] == 0:
        e, o = e[:-1], o[:-1]
    chi2, df = float(((o - e) ** 2 / e).sum()), len(e) - 1
    if df < 1:
        return 0.0
    return ((chi2 / df) ** (1 / 3) - (1 - 2 / (9 * df))) / math.sqrt(2 / (9 * df))


@pytest.fixture(scope="module")
def target():
    return tiny_target(vocab_size=V, seed=3)  # over 10 tokens several are plausible each time (p up to ~0.3)


@pytest.mark.parametrize("name,cfg", [
    ("chain", dict(mode="chain", num_speculative_tokens=2, temperature=1.0)),
    ("dynamic tree, top-p", dict(mode="dynamic", top_k=3, depth=3, total_tokens=6, temperature=0.9, top_p=0.9)),
    ("static tree, adaptive lookup", dict(mode="static", tree="[[0], [1], [0, 0]]", temperature=1.0,
                                          prompt_lookup_num_tokens=3, prompt_lookup_min=1,
                                          prompt_lookup_adaptive=True)),
    ("draft model, top-k", dict(num_speculative_tokens=3, temperature=1.1, sampling_top_k=6)),
    # draft vocabularies of 6 of the 10 tokens: q is 0 on the other 4, which the target must still emit
    ("EAGLE-1 head, draft vocabulary", dict(mode="static", tree="[[0], [1], [0, 0], [0, 1]]", temperature=1.0)),
    ("EAGLE-3 head, draft vocabulary", dict(mode="chain", num_speculative_tokens=3, temperature=0.8, top_p=0.95)),
])
def test_later_rounds_sample_the_target_law(target, name, cfg):
    if name.startswith("draft model"):
        dec = SpeculativeDecoder.from_pretrained(target, draft_model=tiny_target(vocab_size=V, seed=7))
    else:
        torch.manual_seed(4)
        kind = dict(head_type="eagle3", feature_layer_ids=[0, 1, 2]) if "EAGLE-3" in name else {}
        vocab = dict(draft_vocab_size=6) if "vocabulary" in name else {}
        head = make_head(HeadConfig.for_target(target, **kind, **vocab)).to(target.dtype).attach(target)
        if vocab:
            head.set_draft_vocab(torch.tensor([0, 2, 4, 5, 7, 9]))  # 3, the EOS, left out too
        with torch.no_grad():  # a random head's q is nearly flat: sharpen it, so that it is far from p
            head.fc.weight.mul_(4.0)
        dec = SpeculativeDecoder(target, head)
    law = exact_law(target, PROMPT, cfg, N)
    assert abs(sum(law.values()) - 1.0) < 1e-6  # process() works in float32
    trials, g = 1200, torch.Generator().manual_seed(11)
    drawn: dict[tuple, float] = {}
    rounds = 0
    for _ in range(trials):
        out = dec.generate(PROMPT, N, generator=g, **cfg)
        seq = tuple(out.token_ids) + (V,) * (N - len(out.token_ids))
        drawn[seq] = drawn.get(seq, 0.0) + 1.0 / trials
        rounds += out.rounds
    assert set(drawn) <= set(law), set(drawn) - set(law)  # nothing the target cannot say (after an EOS, past top-p)
    assert rounds >= 2 * trials, rounds / trials  # 2.2-2.9 rounds a trial: the later rounds emit most tokens
    for positions in [(2,), (3,), (4,), (2, 3), (3, 4)]:
        z = chi2_z(marginal(drawn, positions).flatten() * trials, marginal(law, positions).flatten() * trials)
        assert z < 4.5, (name, positions, z)  # ~3e-6 for an exact sampler; q misread after round 1: 6-12
