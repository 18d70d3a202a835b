"""The draft losses: EAGLE-1/2's feature regression plus cross-entropy against the target's distribution, and
EAGLE-3's cross-entropy over the draft vocabulary with the head unrolled on its own outputs (the training-time test).

    loss, metrics = head_loss(head, ids, mask, feats, cfg, gen)     # gen: a generator on the training device

Loss (EAGLE-1/2): smooth-L1 between the predicted and the target's next feature, plus `ce_weight` x the
cross-entropy of the draft distribution q against the target's distribution p at that position; input features
get uniform noise. Loss (EAGLE-3): the cross-entropy alone, with the head unrolled for `loss.steps` steps, each step
attending as drafting does (`unrolled`): dense (every position) or along random chains (`loss.unroll_fraction`).
The randomness (noise, dropout masks, chain starts) comes from one generator on the training device, seeded by the
step, so a resumed run draws what the uninterrupted one did.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from eagle import EagleHead, HeadCache
from train.config import TrainConfig


def unrolled_mask(n: int, s: int) -> torch.Tensor:
    """[n, s*n] bool attention of unrolled step s over the keys of steps 1..s, all aligned by position p.

    When drafting, the step-s token at position p sees the true (step 1) entries up to p-s+1 and the drafted
    entries of steps r = 2..s at position p-s+r.
    """
    i = torch.arange(n)
    blocks = [i[None] <= (i[:, None] - (s - 1))]
    blocks += [i[None] == (i[:, None] - (s - r)) for r in range(2, s + 1)]
    return torch.cat(blocks, dim=1)


def unrolled(head: EagleHead, x: torch.Tensor, next_ids: torch.Tensor, steps: int,
             starts: torch.Tensor | None = None):
    """Yield (s, predictions, positions) for s = 1..steps: the training-time test, shared by the loss and
    benchmarks/depth_agreement.py. Step 1 reads the features x [B, n, *] with the tokens next_ids [B, n] at every
    position (predictions [B, n, H], positions arange(n)). Step s > 1 reads, at position p, step s-1's prediction
    made at p - 1, attending as drafting does (`unrolled_mask`): at every position (`starts` None), or only along
    the m chains drafted from the positions `starts` [m] (sorted, at most n - steps; predictions [B, m, H]): chain
    j's step s sits at starts[j] + s - 1 and sees the true entries up to starts[j] and its own drafted entries, so
    each later step costs m rows instead of n."""
    B, n = next_ids.shape
    dev = next_ids.device
    pos = torch.arange(n, device=dev)
    cache = HeadCache() if steps > 1 else None
    pred = head(x, next_ids, pos[None].expand(B, -1), cache=cache)
    yield 1, pred, pos
    if starts is not None:
        m = starts.shape[0]
        pred = pred[:, starts]
        seen = pos[None] <= starts[:, None]  # [m, n] the true entries each chain sees
        own = torch.eye(m, dtype=torch.bool, device=dev)
    for s in range(2, steps + 1):
        if starts is None:
            x = torch.cat([torch.zeros_like(pred[:, :1]), pred[:, :-1]], dim=1)
            pred = head(x, next_ids, pos[None].expand(B, -1), cache=cache, mask=unrolled_mask(n, s).to(dev))
            yield s, pred, pos
        else:
            q = starts + (s - 1)
            pred = head(pred, next_ids[:, q], q[None].expand(B, -1), cache=cache,
                        mask=torch.cat([seen] + [own] * (s - 1), dim=1))
            yield s, pred, q


def chain_starts(n: int, steps: int, fraction: float, gen: torch.Generator | None) -> torch.Tensor | None:
    """Random chain starts for a sparse training-time test (`loss.unroll_fraction` of the n positions), or None
    for the dense one (every position), drawn on `gen`'s device. Starts run to n - steps, so every chain has all its
    steps; the last steps - s positions of a batch are never trained at step s < steps."""
    room = n - steps + 1
    if steps == 1 or fraction >= 1.0 or room < 1:
        return None
    m = max(1, min(room, math.ceil(fraction * n)))
    return torch.randperm(room, generator=gen, device=gen.device if gen is not None else "cpu")[:m].sort().values


def head_inputs(head: EagleHead, feats: torch.Tensor, noise: float = 0.0, gen=None) -> torch.Tensor:
    """The head's step-1 input features at positions 0..T-2: the target's last features (EAGLE-1/2, with uniform
    noise of width `noise` when training) or its fused layers (EAGLE-3)."""
    H = head.config.hidden_size
    if head.config.head_type == "eagle3":
        return feats[:, :-1, H:]
    x = feats[:, :-1, :H]
    if noise:  # drawn where `gen` is, the training device: the same draws on a resumed run
        x = x + ((torch.rand(x.shape, generator=gen, device=gen.device) - 0.5) * noise).to(x.device, x.dtype)
    return x


def head_loss(head: EagleHead, ids, mask, feats, cfg: TrainConfig, gen, noise: bool = True):
    """The draft loss on one batch; `feats` holds the target's last features, then (EAGLE-3) its fused layers.

    EAGLE-1/2: predict feature t+1 from (feature t, token t+1); smooth-L1 on the feature plus ce_weight x CE
    against the target's p (or p's top token, `loss.ce_target`; or -log sum min(p, q), `loss.divergence=lk`; "ce"
    in the stats is that term). EAGLE-3: that term alone, over the draft vocabulary;
    positions whose next token lies outside it are not scored (the data is the target's own greedy text, so that
    token is the target's argmax).
    Scored where token t+2 is an assistant token. `noise=False` (validation) feeds the features as drafting does,
    without the training noise. With `loss.steps` > 1 the head is unrolled on its own outputs
    (the training-time test, see `unrolled`), step s weighted step_decay^(s-1). p and q are taken over the
    head's draft vocabulary (renormalised there when it is reduced).
    """
    eagle3 = head.config.head_type == "eagle3"
    H = head.config.hidden_size
    B, T = ids.shape
    n = T - 1
    last = feats[..., :H]
    x = head_inputs(head, feats, cfg.loss.noise if noise else 0.0, gen)
    head.set_dropout(cfg.optim.dropout if noise else 0.0, gen)  # after the noise's draws: those stay as they were
    scored = torch.zeros(B, n, dtype=torch.bool, device=mask.device)
    scored[:, :-1] = mask[:, 2:]
    if eagle3:
        scored[:, :-1] &= head.t2d[ids[:, 2:]]
    total, stats = 0.0, {}
    starts = chain_starts(n, cfg.loss.steps, cfg.loss.unroll_fraction if noise else 1.0, gen)
    for s, pred, q in unrolled(head, x, ids[:, 1:], cfg.loss.steps,
                               None if starts is None else starts.to(ids.device)):
        sel = scored[:, q].clone()
        if starts is None:
            sel[:, : s - 1] = False  # positions before s-1 have no step-s input
        out, want = pred[sel], last[:, 1:][:, q][sel]  # only scored positions reach the costly lm_head
        if out.shape[0] == 0:  # nothing scored at this step (a later chain step may still be)
            continue
        with torch.no_grad():
            p = F.softmax(head.target_logits(want).float(), dim=-1)  # float32 even when the products run in bfloat16
        log_q = F.log_softmax(head.logits(out).float(), dim=-1)
        if cfg.loss.divergence == "lk":  # -log sum_x min(p, q): the gradient reaches q only where q < p
            ce = -torch.minimum(p, log_q.exp()).sum(-1).clamp(min=1e-6).log().mean()
        elif cfg.loss.ce_target == "argmax":
            ce = F.nll_loss(log_q, p.argmax(-1))
        else:
            ce = -(p * log_q).sum(-1).mean()
        if eagle3:
            step_loss = ce
        else:
            feat_loss = F.smooth_l1_loss(out.float(), want.float())
            step_loss = cfg.loss.feature_weight * feat_loss + cfg.loss.ce_weight * ce
        total = total + cfg.loss.step_decay ** (s - 1) * step_loss
        acc = (log_q.argmax(-1) == p.argmax(-1)).float().mean().item()
        if s == 1:
            stats = {"ce": ce.item(), "acc": acc, "tokens": out.shape[0]}
            if not eagle3:
                stats["feat"] = feat_loss.item()
        else:
            stats[f"acc{s}"] = acc
    return total, {"loss": total.item(), **stats}
