"""Validation: chain decoding simulated along every held-out row (no target pass: its features and greedy tokens
are known), the loss and agreement there, and real decoding of a few held-out prompts as a check.

    v = validate(head, target, val_rows, val_feats, prompts, cfg, ranks, decode_target)
    v["val_sim_tau"], v["val_sim_accept"], v["val_in_vocab"], v.get("val_tau")

The simulated tau picks the best head: along rows the target wrote itself it equals real decoding's round for round
(`simulate_chain`), on every held-out row instead of a few prompts.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from eagle import EagleHead, TargetModel
from eagle.head import SHARED_PREFIXES, make_head
from train.config import TrainConfig
from train.data import collate, make_batches
from train.losses import head_inputs, head_loss, unrolled
from train.parallel import Ranks


def simulate_chain(ok: torch.Tensor, scored: torch.Tensor) -> list[int]:
    """Accepted drafts per round of greedy chain decoding along one row (the target's own text when the rows were
    regenerated: then decoding its prompt writes exactly this row).

    ok [n, k] bool: the head unrolled s + 1 steps (`unrolled`) agrees at index j with the target's token j + 2;
    scored [n] bool: token j + 2 is an assistant token. A reply's first token comes from the target (its prefill),
    so the first round starts one index into each assistant span; a round starting at index i (the target's
    features known up to i, token i + 1 known) accepts drafts 1..a while ok[i + s - 1, s - 1] holds and the tokens
    stay in the span, then the target's own token follows and the next round starts at i + a + 1. This is what
    `SpeculativeDecoder` does with k drafts on the same text, so it measures acceptance without running the target.
    """
    n, k = ok.shape
    ok_l, sc = ok.tolist(), scored.tolist()
    accepts, i = [], 0
    while i < n:
        if not sc[i]:
            i += 1
            continue
        i += 1  # the span's first token is the target's; rounds start after it
        while i < n and sc[i]:
            a = 0
            while a < k and i + a < n and sc[i + a] and ok_l[i + a][a]:
                a += 1
            accepts.append(a)
            i += a + 1
    return accepts


@dataclass
class SimBatch:
    """Simulated chain decoding of one batch: the accepted drafts of each round, per row, and how many scored
    positions there were and at how many the target's token lies in the head's draft vocabulary (a first draft can
    only be accepted there: the draft vocabulary caps first-position acceptance at in_vocab / scored)."""

    accepts: list[list[int]]
    scored: int
    in_vocab: int


@torch.no_grad()
def batch_accepts(head: EagleHead, target: TargetModel, ids, mask, f, k: int) -> SimBatch:
    """`simulate_chain` for each row of one right-padded batch (ids, loss mask, features: a `train.data.Batch`'s):
    one unrolled pass of the head; the truth is the target's argmax from its features, so the rows need not be
    the target's own text."""
    W = target.lm_head.weight
    p = next(head.parameters())
    ids, f = ids.to(p.device), f.to(p.device, p.dtype)
    scored = torch.zeros(ids.shape[0], ids.shape[1] - 1, dtype=torch.bool, device=p.device)
    scored[:, :-1] = mask[:, 2:]
    sel = scored.nonzero(as_tuple=True)
    want = f[:, 1:, : head.config.hidden_size][sel].to(W.dtype)  # feature j + 1 gives the target's token j + 2
    truth = torch.cat([F.linear(c, W).argmax(-1) for c in want.split(1024)] or [sel[0][:0]])
    ok = torch.zeros(*scored.shape, k, dtype=torch.bool, device=p.device)
    for s, pred, _ in unrolled(head, head_inputs(head, f), ids[:, 1:], k):
        ok[sel[0], sel[1], s - 1] = head.to_target_ids(head.logits(pred[sel]).argmax(-1)) == truth
    in_vocab = int(torch.isin(truth, head.d2t).sum()) if head.config.draft_vocab_size else truth.numel()
    ok, scored = ok.cpu(), scored.cpu()
    # padded positions are never scored, so each padded row simulates as the row alone
    return SimBatch([simulate_chain(ok[b], scored[b]) for b in range(ids.shape[0])], truth.numel(), in_vocab)


def simulated_accepts(head: EagleHead, target: TargetModel, rows, feats, k: int, batch_tokens: int,
                      layers: list[int] | None = None) -> list[list[int]]:
    """Per row, the accepted drafts of each round of chain decoding with k drafts (`batch_accepts`)."""
    out: list[list[int]] = [[] for _ in rows]
    for idx in make_batches([r[0].shape[0] for r in rows], batch_tokens, torch.Generator().manual_seed(0)):
        b = collate(rows, feats, idx, target, layers)
        sim = batch_accepts(head, target, b.ids, b.mask, b.feats, k)
        for i, accepts in zip(idx, sim.accepts):
            out[i] = accepts
    return out


def depth_counts(accepts: list[int], k: int) -> list[tuple[int, int]]:
    """(rounds that accepted draft s, rounds that checked it) for s = 1..k, from accepted counts per round."""
    return [(sum(a >= s for a in accepts), sum(a >= s - 1 for a in accepts)) for s in range(1, k + 1)]


def acceptance_stats(accepts: list[int], k: int) -> dict:
    """tau (tokens per target pass) and the conditional acceptance at each depth of a list of accepted counts."""
    rounds = max(len(accepts), 1)
    rates = [a / max(n, 1) for a, n in depth_counts(accepts, k)]
    return {"tau": (sum(accepts) + len(accepts)) / rounds, "accept": [round(r, 4) for r in rates]}


def decoding_head(head: EagleHead, target: TargetModel) -> EagleHead:
    """The head as decoding runs it with `target`: itself, or a copy of its weights in the target's dtype attached to
    `target` (training keeps float32 master weights beside a 16-bit target, and may hold the target without its
    layers apart from the whole one that decodes)."""
    if next(head.parameters()).dtype == target.dtype and head.lm_head is target.lm_head:
        return head
    twin = make_head(head.config).to(device=target.device, dtype=target.dtype)
    missing, unexpected = twin.load_state_dict(head.trainable_state_dict(), strict=False)
    if unexpected or any(not k.startswith(SHARED_PREFIXES) for k in missing):  # only the target's own may be left
        raise ValueError(f"the head's copy for decoding lacks {missing[:3]} / has no place for {unexpected[:3]}")
    return twin.eval().attach(target)


def validate(head, target, val_rows, val_feats, prompts, cfg: TrainConfig, ranks: Ranks = Ranks(),
             decode_target: Callable[[], TargetModel] | None = None) -> dict:
    """On the held-out rows: teacher-forced loss and top-1 agreement, and the tau and per-depth acceptance of chain
    decoding with eval.num_speculative_tokens drafts simulated along them (`batch_accepts`: every row, no
    target pass); plus tau from real chain decoding of eval.num_prompts held-out prompts, a check of the
    simulation on a few prompts. With several processes each takes its share of the batches (the sums are
    reduced) and the main process decodes the prompts, with `decode_target()` (the target with its decoder layers;
    default `target`) and the head in its dtype."""
    from infer import SpeculativeDecoder

    head.eval()
    gen = torch.Generator().manual_seed(0)
    layers = list(head.config.feature_layer_ids) if head.config.head_type == "eagle3" else None
    k, accepts, sums = cfg.eval.num_speculative_tokens, [], torch.zeros(5, dtype=torch.float64)
    p = next(head.parameters())
    batches = make_batches([r[0].shape[0] for r in val_rows], cfg.optim.batch_tokens, gen)
    with torch.no_grad():
        for idx in batches[ranks.index::ranks.count]:
            b = collate(val_rows, val_feats, idx, target, layers)  # online: one target pass
            ids, mask, feats = b.ids.to(p.device), b.mask.to(p.device), b.feats.to(p.device, p.dtype)
            _, m = head_loss(head, ids, mask, feats, cfg, gen, noise=False)
            sim = batch_accepts(head, target, ids, mask, feats, k)
            sums += torch.tensor([m["loss"] * m["tokens"], m["acc"] * m["tokens"], m["tokens"], sim.in_vocab,
                                  sim.scored], dtype=torch.float64)
            accepts += [a for row in sim.accepts for a in row]
    if ranks.count > 1:  # (float64 on the processes' device: NCCL reduces CUDA tensors)
        sums = ranks.sum_(sums.to(p.device)).cpu()
    accepts = [a for part in ranks.gather(accepts) for a in part]
    # val_acc is agreement over the draft vocabulary (p renormalised there, as the loss sees it); val_in_vocab is the
    # share of the target's next tokens inside it, which caps real first-draft acceptance
    stats = {"val_loss": float(sums[0] / max(sums[2], 1)), "val_acc": float(sums[1] / max(sums[2], 1)),
             "val_in_vocab": float(sums[3] / max(sums[4], 1))}
    sim = acceptance_stats(accepts, k)
    stats["val_sim_tau"], stats["val_sim_accept"] = sim["tau"], sim["accept"]
    if prompts:
        tau = None
        if ranks.main:
            whole = (decode_target or (lambda: target))()
            dec = SpeculativeDecoder(whole, decoding_head(head, whole))
            emitted = rounds = 0
            for prompt in prompts:
                out = dec.generate(prompt, cfg.eval.max_new_tokens,
                                   num_speculative_tokens=cfg.eval.num_speculative_tokens, cpu=cfg.cpu)
                emitted += sum(out.accept_lengths) + out.rounds
                rounds += out.rounds
            tau = emitted / max(rounds, 1)
        stats["val_tau"] = ranks.from_main(tau)
    head.train()
    return stats
