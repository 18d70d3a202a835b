"""Train an EAGLE-1/2 or EAGLE-3 head on rows prepared by `eagle prep`; resumable, budgeted by steps, minutes or
epochs.

    eagle train --config configs/smollm2-135m-eagle1.yaml budget.minutes=10
    eagle train --config configs/smollm2-135m-eagle3.yaml data.online=true

Loss (EAGLE-1/2): smooth-L1 between the predicted and the target's next feature, plus `ce_weight` x the
cross-entropy of the draft distribution q against the target's distribution p at that position; input features
get uniform noise. Loss (EAGLE-3): the cross-entropy alone, over the draft vocabulary, with the head unrolled on
its own outputs for `loss.steps` steps (the training-time test). Target features are computed once and cached
beside the prepared rows, or per batch with `data.online=true`. Rerunning the same command resumes from
`run_dir/checkpoint` (written whole or not at all: a kill at any instant, SIGKILL included, resumes from the last
complete checkpoint; see `save_checkpoint`); the head with the best validation tau (chain decoding simulated
along every held-out row, `batch_accepts`) is exported to `out`.
"""

from __future__ import annotations

import copy
import functools
import json
import math
import os
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm import tqdm

import cpu_backend
from data_prep import draft_vocabulary, load_examples
from eagle import EagleHead, HeadCache, HeadConfig, TargetModel, load_target
from eagle.checkpoint import check_head_dir, fsync_path, recover_dir, replace_dir, save_head
from eagle.features import (DTYPES as FEATURE_DTYPES, FeatureError, FeatureStore, FeatureWriter, check_room,
                            default_dtype, features_dir)
from eagle.configio import save_config
from eagle.faults import fault
from eagle.device import native_bfloat16, resolve_device, resolve_dtype
from eagle.head import eagle3_layers, load_head, make_head
from eagle.memory import TargetSize
from eagle.target import target_config
from train.config import TrainConfig
from train.plan import check_training_fits
from train.parallel import Ranks, average_gradients
from train.runlog import RunLog


class TrainError(ValueError):
    pass


# -- data ---------------------------------------------------------------------------------------------------------
def load_rows(cfg: TrainConfig, split: str, prepared: str) -> list[tuple[torch.Tensor, torch.Tensor]]:
    path = Path(prepared) / f"{split}.jsonl"
    if not path.exists():
        raise TrainError(f"prepared data {str(path)!r} does not exist: run `eagle prep --out {prepared}` first")
    rows = []
    for ex in load_examples(path):
        ids = torch.tensor(ex.input_ids[: cfg.data.max_length])
        mask = torch.tensor(ex.loss_mask[: cfg.data.max_length], dtype=torch.bool)
        if mask[2:].any():  # a row must have something to learn (predictions start two tokens in)
            rows.append((ids, mask))
    if not rows:
        raise TrainError(f"prepared data {str(path)!r} has no row with assistant tokens")
    return rows


def _reply_grams(ids: torch.Tensor, mask: torch.Tensor, n: int) -> set[tuple[int, ...]]:
    """The distinct n-grams of a row's assistant (loss-masked) tokens."""
    a = ids[mask].tolist()
    return {tuple(a[i:i + n]) for i in range(len(a) - n + 1)}


def repeat_free(rows, val_rows, max_shared: float = 0.5, n: int = 8) -> list[int]:
    """The indices of the training rows that repeat no validation row. A training row repeats a validation row when
    it is identical to it, or when its assistant text holds at least `max_shared` of the validation row's distinct
    assistant n-grams: ShareGPT asks the same thing in other words ("continue" and "continue please" get the very
    same regenerated reply). Prepared shards are split on their
    own, so a row repeated across shards (or data.extra holding the validation shard's rows) would otherwise be
    trained on and scored."""
    held_out = {tuple(ids.tolist()) for ids, _ in val_rows}
    owners: dict[tuple[int, ...], list[int]] = {}  # n-gram -> the validation rows whose replies hold it
    need = []  # shared n-grams that make a training row a repeat of validation row j
    for j, (ids, mask) in enumerate(val_rows if max_shared <= 1 else []):  # above 1: identical rows only
        grams = _reply_grams(ids, mask, n)
        need.append(max(1.0, max_shared * len(grams)))
        for g in grams:
            owners.setdefault(g, []).append(j)

    def repeats(ids, mask) -> bool:
        if tuple(ids.tolist()) in held_out:
            return True
        if not owners:
            return False
        shared = [0] * len(val_rows)
        for g in _reply_grams(ids, mask, n) & owners.keys():
            for j in owners[g]:
                shared[j] += 1
        return any(c >= need[j] for j, c in enumerate(shared) if c)

    return [i for i, (ids, mask) in enumerate(rows) if not repeats(ids, mask)]


def drop_val_rows(rows, feats, val_rows, max_shared: float = 0.5, n: int = 8):
    """Training rows (and their features, if cached) less those that repeat a validation row (`repeat_free`), and
    how many were left out."""
    keep = repeat_free(rows, val_rows, max_shared, n)
    if len(keep) == len(rows):
        return rows, feats, 0
    kept = None if feats is None else feats.take(keep) if isinstance(feats, FeatureStore) else [feats[i] for i in keep]
    return [rows[i] for i in keep], kept, len(rows) - len(keep)


def make_batches(lengths: list[int], batch_tokens: int, gen: torch.Generator,
                 groups: list[list[int]] | None = None) -> list[list[int]]:
    """Group rows of similar length so a padded batch holds about `batch_tokens` tokens; shuffled batch order.
    `groups` (row indices, e.g. one group per data source): each group is batched and shuffled on its own and the
    groups follow each other in the order given; None: every row in one group."""
    batches = []
    for group in groups if groups is not None else [range(len(lengths))]:
        order = sorted(group, key=lambda i: lengths[i])
        part, cur = [], []
        for i in order:
            if cur and (len(cur) + 1) * lengths[i] > batch_tokens:
                part.append(cur)
                cur = []
            cur.append(i)
        if cur:
            part.append(cur)
        batches += [part[p] for p in torch.randperm(len(part), generator=gen).tolist()]
    return batches


def row_groups(cfg: TrainConfig, data: TrainData) -> list[list[int]] | None:
    """The row groups `make_batches` takes for `data.order`: None (mixed), or the extra rows, then the prepared."""
    if cfg.data.order == "mixed":
        return None
    extra = [i for i, s in enumerate(data.sources) if s > 0]
    return [g for g in (extra, [i for i, s in enumerate(data.sources) if s == 0]) if g]


def collate(rows, feats, idx: list[int], target: TargetModel | None = None, layers: list[int] | None = None,
            all_positions: bool = False):
    """Right-padded (ids, loss mask, features) of the rows `idx`; without cached `feats` the target computes the
    features now (online training). With `all_positions` the mask is every real (unpadded) position."""
    T = max(rows[i][0].shape[0] for i in idx)
    B = len(idx)
    ids = torch.zeros(B, T, dtype=torch.long)
    mask = torch.zeros(B, T, dtype=torch.bool)
    for b, i in enumerate(idx):
        n = rows[i][0].shape[0]
        ids[b, :n], mask[b, :n] = rows[i][0], True if all_positions else rows[i][1]
    if feats is None:
        return ids, mask, batch_features(target, ids, layers)
    f = torch.zeros(B, T, feats[idx[0]].shape[-1], dtype=torch.promote_types(feats[idx[0]].dtype, torch.float32))
    for b, i in enumerate(idx):
        f[b, : rows[i][0].shape[0]] = feats[i]
    return ids, mask, f


def cached_features(target: TargetModel, rows, prepared: Path, split: str, layers: list[int] | None = None,
                    dtype: torch.dtype | None = None,
                    pass_target: Callable[[], TargetModel] | None = None) -> FeatureStore:
    """Target features of every row, kept in `dtype` (None: any dtype a complete store of the target's is in, else
    the target's) in a store beside the prepared rows (eagle.features: shards written as they are computed, read a
    row at a time) so later runs on the same data skip the pass; prep leaves them there when regeneration computed
    them already. Its size is printed, and checked against the free disk, before anything is written; a pass killed
    midway resumes after its last complete shard.

    `pass_target` (a callable returning a TargetModel: `target` with its layers, or a bfloat16 copy) computes the
    features when `target` has none stored for these rows (default: `target.whole()`); a store is keyed by the
    identity of the target that computed it, so a copy's never passes for `target`'s."""
    lengths = [r[0].shape[0] for r in rows]
    store = _stored_features(target, lengths, prepared, split, layers, dtype)
    if store is None:
        computing = (pass_target or target.whole)()
        if computing.identity != target.identity:
            store = _stored_features(computing, lengths, prepared, split, layers, dtype)
        target = computing
    dtype = dtype or default_dtype(target.dtype)
    folder = features_dir(prepared, split, target, layers, dtype)
    if store is None:
        width = target.hidden_size * (1 + len(layers or []))
        with FeatureWriter(folder, lengths, width, dtype) as w:
            todo = w.missing()
            size = sum(lengths[i] for i in todo) * width * dtype.itemsize
            print(f"target features ({split}): {sum(lengths):,} tokens x {width} {str(dtype).removeprefix('torch.')} "
                  f"= {sum(lengths) * width * dtype.itemsize / 2**20:,.1f} MiB in {folder}"
                  + (f" ({len(lengths) - len(todo)} rows there already)" if len(todo) < len(lengths) else ""))
            check_room(folder, size, f"target features ({split})")
            target_features(target, rows, todo, w, f"target features ({split})", layers)
        store = FeatureStore.open(folder, lengths)
    if store is None:  # written whole just now, yet unreadable: the disk or another writer, not this pass
        raise FeatureError(f"target features ({split}): the store in {str(folder)!r} was written but cannot be read "
                           "back; check the disk, delete the folder and run again")
    return store


def _stored_features(target: TargetModel, lengths: list[int], prepared: Path, split: str, layers: list[int] | None,
                     dtype: torch.dtype | None) -> FeatureStore | None:
    """`target`'s complete store of these rows in `dtype` (None: in its own dtype, or any other), or, for a 16-bit
    `dtype`, its float32 one converted, or None."""
    if dtype is None:
        kinds = dict.fromkeys([default_dtype(target.dtype), torch.float32, torch.bfloat16, torch.float16])
        found = (FeatureStore.open(features_dir(prepared, split, target, layers, d), lengths) for d in kinds)
        return next((s for s in found if s is not None), None)
    folder = features_dir(prepared, split, target, layers, dtype)
    store = FeatureStore.open(folder, lengths)
    if store is None and dtype != torch.float32:  # a float32 store of the same rows, converted
        wide = FeatureStore.open(features_dir(prepared, split, target, layers), lengths)
        if wide is not None:
            check_room(folder, sum(lengths) * wide.width * dtype.itemsize, f"target features ({split})")
            with FeatureWriter(folder, lengths, wide.width, dtype) as w:
                for i in w.missing():
                    w.add(i, wide[i])
            store = FeatureStore.open(folder, lengths)
    return store


@torch.inference_mode()
def batch_features(target: TargetModel, ids: torch.Tensor, layers: list[int] | None = None) -> torch.Tensor:
    """[B, T, H] post-norm last hidden states of right-padded rows, with the `layers` appended ([B, T, (1+n)H])."""
    last, aux = target.hidden(ids.to(target.device), layers=layers)
    return (last if aux is None else torch.cat([last, aux], dim=-1)).float().cpu()


@torch.inference_mode()
def target_features(target: TargetModel, rows, todo: list[int], writer: FeatureWriter, desc: str,
                    layers: list[int] | None = None) -> None:
    """Run the target once over the rows `todo` (batched by length) and hand their post-norm last hidden states
    (followed by the `layers` an EAGLE-3 head reads) to `writer`, which writes them shard by shard."""
    order = sorted(todo, key=lambda i: rows[i][0].shape[0])
    bar = tqdm(total=sum(rows[i][0].shape[0] for i in todo), desc=desc, unit="tok", dynamic_ncols=True)
    i = 0
    while i < len(order):
        T = rows[order[i]][0].shape[0]
        j = i + max(1, 4096 // T)
        idx = order[i:j]
        T = max(rows[k][0].shape[0] for k in idx)
        ids = torch.zeros(len(idx), T, dtype=torch.long)
        for b, k in enumerate(idx):
            ids[b, : rows[k][0].shape[0]] = rows[k][0]  # right padding: causal attention keeps rows intact
        feats = batch_features(target, ids, layers)
        for b, k in enumerate(idx):
            writer.add(k, feats[b, : rows[k][0].shape[0]])
        bar.update(sum(rows[k][0].shape[0] for k in idx))
        i = j
    bar.close()


# -- loss ---------------------------------------------------------------------------------------------------------
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
    for the dense one (every position). Starts run to n - steps, so every chain has all its steps; the last
    steps - s positions of a batch are never trained at step s < steps."""
    room = n - steps + 1
    if steps == 1 or fraction >= 1.0 or room < 1:
        return None
    m = max(1, min(room, math.ceil(fraction * n)))
    return torch.randperm(room, generator=gen)[:m].sort().values


def head_inputs(head: EagleHead, feats: torch.Tensor, noise: float = 0.0, gen=None) -> torch.Tensor:
    """The head's step-1 input features at positions 0..T-2: the target's last features (EAGLE-1/2, with uniform
    noise of width `noise` when training) or its fused layers (EAGLE-3)."""
    H = head.config.hidden_size
    if head.config.head_type == "eagle3":
        return feats[:, :-1, H:]
    x = feats[:, :-1, :H]
    if noise:
        x = x + ((torch.rand(x.shape, generator=gen) - 0.5) * noise).to(x.device, x.dtype)  # CPU draws: exact resume
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


# -- simulated decoding -------------------------------------------------------------------------------------------
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
    """`simulate_chain` for each row of one right-padded batch (ids, loss mask, features, as `collate` gives them):
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
        sim = batch_accepts(head, target, *collate(rows, feats, idx, target, layers), k)
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


# -- checkpoints --------------------------------------------------------------------------------------------------
def save_checkpoint(run: Path, head, optim: Optim, state: dict) -> None:
    """run/checkpoint holds head + optimizer + trainer state. It is written whole into run/checkpoint.tmp (a partial
    one left by a kill is removed first: the name is ours) and flushed to the disk, then renamed in by
    `eagle.checkpoint.replace_dir`: the previous checkpoint is renamed to run/checkpoint.prev and removed only once
    the new one is in place, and `last_checkpoint` puts checkpoint.prev back when a kill came between the two
    renames. So a kill at any instant leaves a complete checkpoint. EAGLE_FAULT=checkpoint-between-renames[@STEP]
    kills the process between the renames (`fault`)."""
    check_finite(head, run, state)
    tmp = run / "checkpoint.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    save_head(head, tmp / "head")
    optim.save(tmp, state)
    (tmp / "state.json").write_text(json.dumps(state))
    for f in (tmp / "optimizer.pt", tmp / "state.json", tmp):
        fsync_path(f)
    replace_dir(tmp, run / "checkpoint", between=lambda: fault("checkpoint-between-renames", state["step"]))


def check_finite(head, run: Path, state: dict) -> None:
    """Stop, in one line, before weights that are not finite replace a good checkpoint or head. Every process holds
    the same weights, so every process stops alike."""
    bad = [k for k, v in head.trainable_state_dict().items() if v.is_floating_point() and not v.isfinite().all()]
    if bad:
        raise TrainError(f"the weights are not finite after step {state['step']} ({', '.join(bad[:3])}): training "
                         f"stopped; {last_good(run, state['step'])}")


def last_checkpoint(run: Path) -> Path | None:
    """run/checkpoint, the last complete checkpoint (put back from checkpoint.prev when a kill came between
    `save_checkpoint`'s renames), or None; a partial checkpoint.tmp is never read."""
    return recover_dir(run / "checkpoint")


def last_good(run: Path, step: int) -> str:
    """Where the last checkpoint of a run stopped at `step` is, for its error message: a checkpoint of that very step
    holds the weights that gave the bad loss."""
    ckpt = run / "checkpoint"
    if not (ckpt / "state.json").exists():
        return "no checkpoint was written yet"
    saved = json.loads((ckpt / "state.json").read_text())["step"]
    if saved < step:
        return f"the last good checkpoint, {ckpt} (step {saved}), is kept"
    return f"the last checkpoint, {ckpt} (step {saved}), is kept (the weights this step started from)"


def val_prompts(cfg: TrainConfig) -> list[str]:
    from infer import load_prompts

    path = Path(cfg.data.prepared) / "val_conversations.jsonl"
    if not path.exists() or cfg.eval.num_prompts <= 0:
        return []
    return [p["prompt"] for p in load_prompts(str(path), cfg.eval.num_prompts)]


def decoding_head(head: EagleHead, target: TargetModel) -> EagleHead:
    """The head as decoding runs it with `target`: itself, or a copy of its weights in the target's dtype attached to
    `target` (training keeps float32 master weights beside a 16-bit target, and may hold the target without its
    layers apart from the whole one that decodes)."""
    if next(head.parameters()).dtype == target.dtype and head.lm_head is target.lm_head:
        return head
    twin = make_head(head.config).to(device=target.device, dtype=target.dtype)
    twin.load_state_dict(head.trainable_state_dict(), strict=False)
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
            ids, mask, feats = collate(val_rows, val_feats, idx, target, layers)  # online: one target pass
            ids, mask, feats = ids.to(p.device), mask.to(p.device), feats.to(p.device, p.dtype)
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


# -- the loop -----------------------------------------------------------------------------------------------------
def train(cfg: TrainConfig, target: TargetModel | None = None) -> dict:
    """Train (or resume) the head `cfg` describes, in this process or in each of several (`train.parallel`);
    returns the final trainer state."""
    from accelerate import Accelerator
    from accelerate.utils import InitProcessGroupKwargs

    check_config(cfg)                                    # 1. one-line errors before any time is spent
    # a target handed in decides the device unless the config names one
    device = target.device if target is not None and cfg.device == "auto" else resolve_device(cfg.device)
    if device.type == "cuda" and device.index is not None:
        torch.cuda.set_device(device)  # accelerate takes the current device
    # the target features of a data set are computed by the main process while the others wait at a barrier (hours
    # for a large set on one GPU): a process group that waits that long instead of NCCL's default 10 minutes
    wait = InitProcessGroupKwargs(timeout=timedelta(hours=float(os.environ.get("EAGLE_DIST_TIMEOUT_HOURS", 12))))
    accelerator = Accelerator(cpu=device.type == "cpu", kwargs_handlers=[wait])
    ranks = Ranks.of(accelerator)
    precision = Precision.of(cfg, accelerator.device, target)
    check_launch(cfg, accelerator, precision)
    run = Path(cfg.run_dir)
    state = resume_state(cfg, run, ranks)                # 2. the last complete checkpoint's state, if any
    if state and state.get("done"):
        say(ranks, f"training in {run} already finished at step {state['step']}; best head in {cfg.out}")
        return state
    if not cfg.model.device_map:  # refuse, before the target loads, a run the device cannot hold (train.plan)
        size = TargetSize.of_module(target.model) if target is not None else \
            TargetSize.of(target_config(cfg.model.target)[0])
        check_training_fits(cfg, size, accelerator.device, precision.target.itemsize, precision.head.itemsize,
                            precision.compute.itemsize if precision.compute else None)
    # on cached features a target's decoder layers are not loaded (`load_data` loads them if features are missing)
    target = target or load_target(cfg.model.target, device=accelerator.device, dtype=precision.target,
                                   device_map=cfg.model.device_map or None,
                                   layers=cfg.data.online or bool(cfg.model.device_map))
    with accelerator.main_process_first():               # 3. rows, target features (the main process writes them
        data = load_data(cfg, target, quiet=not ranks.main)  # once), held-out rows and prompts
    head = (load_head(run / "checkpoint" / "head", device=accelerator.device, dtype=precision.head).attach(target)
            if state else new_head(cfg, target, data, accelerator.device, precision.head))  # 4. the head, alike
    head.train()                                                                           # everywhere
    optim = Optim.of(cfg, head, precision)
    if state:                                            # 5. the optimizer (and fp16's loss scale), resumed
        optim.load(run / "checkpoint", state)
    if cfg.cpu.fast_path and cpu_backend.applies(head) and precision.compute is None and \
            precision.target == torch.float32:
        cpu_backend.enable(head)                         # 6. the head's products through the CPU backend
        slower = cpu_backend.plan_training(head, min(cfg.optim.batch_tokens, 1024))  # ... where it beats F.linear's
        if slower:
            say(ranks, f"training products through F.linear for {', '.join(slower)} (measured faster than the kernel)")
    state = fit(cfg, head, optim, target, data, run, state, ranks)  # 7. steps, checkpoints, validation
    say(ranks, f"done: {state['step']} steps, {state['tokens']} tokens in {state['train_s'] / 60:.1f} min of training; "
               f"best simulated validation tau {state['best_tau']:.3f} (k = {cfg.eval.num_speculative_tokens}); "
               f"head in {cfg.out}")
    return state


@dataclass
class Precision:
    """The dtypes of a run, from its config and device: the target's weights (`model.dtype`; auto: bfloat16 on CUDA,
    else float32; a target handed in keeps its own), the head's master weights and AdamW states
    (`model.head_dtype`), a training step's products (`mixed_precision` under autocast; None: the head's dtype),
    and the head written to `out` (`model.save_dtype`; auto: the target's when it is 16-bit, else the head's)."""

    target: torch.dtype
    head: torch.dtype
    compute: torch.dtype | None
    save: torch.dtype

    @classmethod
    def of(cls, cfg: TrainConfig, device: torch.device, target: TargetModel | None = None) -> "Precision":
        cuda = device.type == "cuda"
        if target is not None:
            tdtype = target.dtype
        else:
            tdtype = resolve_dtype(("bfloat16" if cuda else "float32") if cfg.model.dtype == "auto" else cfg.model.dtype)
        mp = ("bf16" if cuda else "none") if cfg.mixed_precision == "auto" else cfg.mixed_precision
        head = resolve_dtype(cfg.model.head_dtype)
        save = (tdtype if tdtype.itemsize == 2 else head) if cfg.model.save_dtype == "auto" else \
            resolve_dtype(cfg.model.save_dtype)
        return cls(tdtype, head, {"none": None, "bf16": torch.bfloat16, "fp16": torch.float16}[mp], save)

    @property
    def mixed_precision(self) -> str:
        return {None: "none", torch.bfloat16: "bf16", torch.float16: "fp16"}[self.compute]


@dataclass
class Optim:
    """What a step updates the head with: AdamW over its trainable parameters (in the head's dtype: float32 master
    weights by default), the loss scaler float16 products need so that small gradients do not vanish (a
    pass-through otherwise), and the run's precision (the products' autocast dtype; the saved head's dtype)."""

    opt: torch.optim.Optimizer
    params: list[torch.Tensor]
    scaler: torch.amp.GradScaler
    precision: Precision

    @classmethod
    def of(cls, cfg: TrainConfig, head: EagleHead, precision: Precision) -> "Optim":
        params = [p for n, p in head.named_parameters()
                  if p.requires_grad and not n.startswith(("embed_tokens.", "lm_head."))]
        opt = torch.optim.AdamW(params, lr=cfg.optim.lr, betas=tuple(cfg.optim.betas),
                                weight_decay=cfg.optim.weight_decay)
        device = params[0].device.type
        return cls(opt, params, torch.amp.GradScaler(device, enabled=precision.compute == torch.float16), precision)

    def save(self, folder: Path, state: dict) -> None:
        torch.save(self.opt.state_dict(), folder / "optimizer.pt")
        if self.scaler.is_enabled():
            state["loss_scale"] = self.scaler.state_dict()

    def load(self, folder: Path, state: dict) -> None:
        self.opt.load_state_dict(torch.load(folder / "optimizer.pt", map_location="cpu", weights_only=True))
        if self.scaler.is_enabled() and "loss_scale" in state:
            self.scaler.load_state_dict(state["loss_scale"])


def check_launch(cfg: TrainConfig, accelerator, precision: Precision) -> None:
    """One-line TrainErrors for launches this loop does not serve: it replicates the head and averages gradients
    itself (train.parallel), so no DeepSpeed, FSDP or XLA plugin; the precision is the config's, not accelerate's;
    a target spread over devices (model.device_map) is for one process."""
    from accelerate.utils import DistributedType

    kind = accelerator.distributed_type
    if kind not in (DistributedType.NO, DistributedType.MULTI_GPU, DistributedType.MULTI_CPU):
        raise TrainError(f"accelerate launched with distributed_type {kind.value}: eagle train runs plain data "
                         "parallel processes (MULTI_GPU or MULTI_CPU); run `accelerate config` without DeepSpeed/FSDP")
    asked = {"no": "none"}.get(accelerator.mixed_precision, accelerator.mixed_precision)
    if asked != "none" and asked != precision.mixed_precision:
        raise TrainError(f"accelerate's mixed_precision is {accelerator.mixed_precision} but the config's "
                         f"mixed_precision is {precision.mixed_precision}: set mixed_precision in the training "
                         "config (none, bf16 or fp16) and launch with --mixed_precision no")
    if cfg.model.device_map and accelerator.num_processes > 1:
        raise TrainError(f"model.device_map {cfg.model.device_map!r} spreads one target over the devices; with "
                         f"{accelerator.num_processes} processes each would load it so: use one process, or none")


def say(ranks: Ranks, text: str) -> None:
    """Print on the main process only."""
    if ranks.main:
        print(text, flush=True)


def check_config(cfg: TrainConfig) -> None:
    """One-line TrainErrors for settings that cannot work, and for a run_dir or out that must not be used: before
    any time is spent (an `out` holding anything but a head is never replaced)."""
    if cfg.model.head_type not in ("eagle1", "eagle3"):
        raise TrainError(f"model.head_type {cfg.model.head_type!r}: expected eagle1 or eagle3")
    if cfg.data.order not in ("mixed", "extra_first"):
        raise TrainError(f"data.order {cfg.data.order!r}: expected mixed or extra_first")
    if cfg.loss.ce_target not in ("p", "argmax"):
        raise TrainError(f"loss.ce_target {cfg.loss.ce_target!r}: expected p or argmax")
    if cfg.loss.divergence not in ("kl", "lk"):
        raise TrainError(f"loss.divergence {cfg.loss.divergence!r}: expected kl or lk")
    if cfg.loss.divergence == "lk" and cfg.loss.ce_target != "p":
        raise TrainError(f"loss.divergence lk compares q with the whole of p; loss.ce_target "
                         f"{cfg.loss.ce_target!r} does not apply (leave it p)")
    if cfg.loss.positions not in ("assistant", "all"):
        raise TrainError(f"loss.positions {cfg.loss.positions!r}: expected assistant or all")
    if cfg.model.num_layers < 1 or (cfg.model.head_type == "eagle3" and cfg.model.num_layers != 1):
        raise TrainError(f"model.num_layers {cfg.model.num_layers}: expected >= 1 for eagle1 heads, 1 for eagle3")
    if not 0.0 < cfg.loss.unroll_fraction <= 1.0:
        raise TrainError(f"loss.unroll_fraction {cfg.loss.unroll_fraction}: expected a fraction in (0, 1]")
    if not (cfg.budget.max_steps or cfg.budget.minutes or cfg.budget.epochs):
        raise TrainError("set a budget: budget.max_steps, budget.minutes or budget.epochs")
    if cfg.data.feature_pass not in ("target", "bfloat16", "auto"):
        raise TrainError(f"data.feature_pass {cfg.data.feature_pass!r}: expected target, bfloat16 or auto")
    if cfg.data.feature_dtype not in ("auto", *FEATURE_DTYPES):
        raise TrainError(f"data.feature_dtype {cfg.data.feature_dtype!r}: expected auto or one of "
                         f"{', '.join(FEATURE_DTYPES)}")
    resolve_device(cfg.device), resolve_dtype(cfg.model.head_dtype)  # one-line DeviceErrors
    for key in ("dtype", "save_dtype"):
        if getattr(cfg.model, key) != "auto":
            resolve_dtype(getattr(cfg.model, key))
    if cfg.mixed_precision not in ("auto", "none", "bf16", "fp16"):
        raise TrainError(f"mixed_precision {cfg.mixed_precision!r}: expected auto, none, bf16 or fp16")
    if cfg.model.init not in ("identity", "target_last_layer", "random"):
        raise TrainError(f"model.init {cfg.model.init!r} is not one of identity, target_last_layer, random")
    if cfg.optim.accumulate < 1:
        raise TrainError(f"optim.accumulate {cfg.optim.accumulate}: expected at least 1 micro-batch a step")
    if not 0.0 <= cfg.optim.dropout < 1.0:
        raise TrainError(f"optim.dropout {cfg.optim.dropout}: expected a rate >= 0 and < 1")
    if not 0 <= cfg.optim.lr <= torch.finfo(torch.float32).max:  # else AdamW's step fails with a RuntimeError
        raise TrainError(f"optim.lr {cfg.optim.lr}: expected a number >= 0 that float32 holds")
    negative = [f"budget.{k} {v}" for k, v in vars(cfg.budget).items() if v < 0]
    if negative:
        raise TrainError(f"{', '.join(negative)}: a budget cannot be negative (0: no limit of that kind)")
    run, out = Path(cfg.run_dir), Path(cfg.out)
    if run.exists() and not run.is_dir():
        raise TrainError(f"run_dir {cfg.run_dir!r} is a file: name a directory for the checkpoints and logs")
    if out.resolve() == run.resolve() or out.resolve() in run.resolve().parents:
        raise TrainError(f"out {cfg.out!r} would hold run_dir {cfg.run_dir!r}: name a directory of its own for the "
                         "head")
    check_head_dir(out, "out ")


def resume_state(cfg: TrainConfig, run: Path, ranks: Ranks = Ranks()) -> dict | None:
    """The run directory made (its resolved config.yaml written, with the number of processes) and the state of its
    last complete checkpoint, or None for a new run; a head write killed between its renames is undone first. The
    main process writes; the others wait, then read the same state."""
    if cfg.num_processes not in (0, ranks.count):
        raise TrainError(f"num_processes {cfg.num_processes} in the config, but {ranks.count} processes were launched")
    if cfg.num_threads:
        torch.set_num_threads(cfg.num_threads)
    if ranks.main:
        recover_dir(Path(cfg.out))
        run.mkdir(parents=True, exist_ok=True)
        last_checkpoint(run)
    ranks.barrier()
    ckpt = run / "checkpoint"
    state = json.loads((ckpt / "state.json").read_text()) if (ckpt / "state.json").exists() else None
    trained_by = (state or {}).get("num_processes", 1)
    if state and not state.get("done") and trained_by != ranks.count:
        raise TrainError(f"run_dir {str(run)!r} was trained by {trained_by} processes: resume it with {trained_by} "
                         f"(launched: {ranks.count}), or start a new run_dir")
    for key in ("accumulate", "batch_tokens"):  # the batches and the place in the epoch depend on them
        was, now = (state or {}).get(key), getattr(cfg.optim, key)
        if state and not state.get("done") and was is not None and was != now:
            raise TrainError(f"run_dir {str(run)!r} was trained with optim.{key} {was}: resume it with {was} "
                             f"(given: {now}), or start a new run_dir")
    cfg.num_processes = ranks.count
    if ranks.main and not (state and state.get("done")):
        save_config(cfg, run / "config.yaml")
    return state


@dataclass
class TrainData:
    rows: list  # (input ids, loss mask) of every training row, from every prepared directory
    feats: FeatureStore | None  # their target features (None: computed per batch, `data.online`)
    val_rows: list
    val_feats: FeatureStore | None
    layers: list[int] | None  # the target layers an EAGLE-3 head fuses
    prompts: list[str]  # held-out prompts decoded at validation
    feature_s: float  # seconds spent on the target features (0 when cached)
    sources: list[int]  # per training row: 0 for data.prepared, i for the i-th data.extra directory
    # the target with its decoder layers, which decodes the prompts (loaded at the first call when training on
    # cached features loaded the target without them, then kept)
    decode_target: Callable[[], TargetModel] | None = None


def load_data(cfg: TrainConfig, target: TargetModel, quiet: bool = False) -> TrainData:
    """The prepared rows of `data.prepared` and `data.extra`, their target features (cached beside the rows), the
    held-out rows and prompts; training rows that repeat a held-out row are left out. A target loaded without its
    decoder layers is loaded whole only if some features are missing (`TargetModel.whole`, once)."""
    sources = [cfg.data.prepared, *cfg.data.extra]
    parts = [load_rows(cfg, "train", src) for src in sources]
    rows, val_rows = [r for part in parts for r in part], load_rows(cfg, "val", cfg.data.prepared)
    layers = None
    if cfg.model.head_type == "eagle3":
        layers = cfg.model.feature_layers or eagle3_layers(target.num_layers)
        bad = [i for i in layers if not 0 <= i <= target.num_layers]
        if bad:
            raise TrainError(f"model.feature_layers {bad}: the target's hidden_states run 0..{target.num_layers}")
    t0 = time.perf_counter()
    feats = val_feats = None
    whole = functools.cache(target.whole)
    if not cfg.data.online:
        dtype = None if cfg.data.feature_dtype == "auto" else getattr(torch, cfg.data.feature_dtype)
        other = feature_pass_target(cfg, target, whole) or whole
        feats = FeatureStore.concat([cached_features(target, part, Path(src), "train", layers, dtype, other)
                                     for src, part in zip(sources, parts)])
        # held-out rows always by the target itself: the simulated tau they give equals real decoding's
        val_feats = cached_features(target, val_rows, Path(cfg.data.prepared), "val", layers, dtype, whole)
    feature_s = time.perf_counter() - t0
    sources = [s for s, part in enumerate(parts) for _ in part]
    keep = repeat_free(rows, val_rows, cfg.data.val_overlap)
    leaked = len(rows) - len(keep)
    if leaked:
        rows, sources = [rows[i] for i in keep], [sources[i] for i in keep]
        feats = None if feats is None else feats.take(keep)
    if leaked and not quiet:
        rule = "identical" if cfg.data.val_overlap > 1 else \
            f"identical, or holding >= {cfg.data.val_overlap:.0%} of its reply's 8-grams"
        print(f"left out {leaked} training rows that repeat a validation row of {cfg.data.prepared} ({rule})")
    prompts = val_prompts(cfg)
    return TrainData(rows, feats, val_rows, val_feats, layers, prompts, feature_s, sources,
                     whole if prompts else None)


def feature_pass_target(cfg: TrainConfig, target: TargetModel,
                        whole: Callable[[], TargetModel] | None = None) -> Callable[[], TargetModel] | None:
    """None when `data.feature_pass` leaves the feature pass to the target as loaded; else a callable that makes (once,
    when a store is missing) the bfloat16 copy of the target (of `whole()`, the target with its layers: default
    `target.whole`) that computes it."""
    whole = whole or target.whole
    want = cfg.data.feature_pass
    if want == "target" or target.dtype == torch.bfloat16 or (want == "auto" and not native_bfloat16(target.device)):
        return None
    return functools.cache(lambda: TargetModel(target.name, copy.deepcopy(whole().model).to(torch.bfloat16),
                                               target.tokenizer, target.source))


def new_head(cfg: TrainConfig, target: TargetModel, data: TrainData, device, dtype) -> EagleHead:
    """A fresh head shaped after the target, over the draft vocabulary `data_prep.draft_vocabulary` picks from the
    training rows, initialised as `model.init` says."""
    torch.manual_seed(cfg.seed)
    vocab = draft_vocabulary(data.rows, target.vocab_size, cfg.model.draft_vocab, target.tokenizer,
                             cfg.model.vocab_counts, cfg.model.vocab_count_rows)
    shape = {"num_layers": cfg.model.num_layers, "fc_bias": cfg.model.fc_bias}
    if data.layers is not None:
        shape.update(head_type="eagle3", feature_layer_ids=data.layers)
    hcfg = HeadConfig.for_target(target, draft_vocab_size=0 if vocab is None else vocab.shape[0], **shape)
    head = make_head(hcfg).to(device=device, dtype=dtype).attach(target)
    if vocab is not None:
        head.set_draft_vocab(vocab.to(device))
    if data.layers is not None:
        head.init_from_target_lm_head(target)
    if cfg.model.init == "identity":
        head.init_identity_fc()
    elif cfg.model.init == "target_last_layer":
        head.init_from_target_layer(target)
    return head


@dataclass
class Schedule:
    """The budget (training seconds and / or steps) and the learning rate over it: linear warm-up, then a cosine
    to zero at the end of the budget."""

    lr: float
    warmup_steps: int
    limit_s: float  # 0: no time limit
    max_steps: int  # 0: no step limit

    def progress(self, state: dict) -> float:
        parts = [state["train_s"] / self.limit_s if self.limit_s else 0.0,
                 state["step"] / self.max_steps if self.max_steps else 0.0]
        return min(1.0, max(parts))

    def lr_at(self, state: dict) -> float:
        warm = min(1.0, (state["step"] + 1) / max(1, self.warmup_steps))
        return self.lr * warm * 0.5 * (1 + math.cos(math.pi * self.progress(state)))


def fit(cfg: TrainConfig, head, optim: Optim, target, data: TrainData, run: Path, state: dict | None,
        ranks: Ranks = Ranks()) -> dict:
    """The training steps from `state` (None: the start) to the end of the budget, with checkpoints every
    `save_every_minutes` and validation every `eval.every_minutes` and at the end; returns the final state. A step
    takes `optim.accumulate` micro-batches on each process (`train.parallel`)."""
    state = state or {"step": 0, "epoch": 0, "batch_in_epoch": 0, "train_s": 0.0, "best_tau": -1.0,
                      "tokens": 0, "done": False, "num_processes": ranks.count,
                      "accumulate": cfg.optim.accumulate, "batch_tokens": cfg.optim.batch_tokens}
    state["feature_s"] = state.get("feature_s", 0.0) + data.feature_s  # every pass this run made, resumed ones too
    lengths = [r[0].shape[0] for r in data.rows]
    per_step = cfg.optim.accumulate * ranks.count  # micro-batches an optimizer step takes, over every process
    groups = row_groups(cfg, data)
    steps_per_epoch = len(make_batches(lengths, cfg.optim.batch_tokens, torch.Generator(), groups)) // per_step
    if steps_per_epoch < 1:
        raise TrainError(f"{len(data.rows)} training rows make fewer batches of optim.batch_tokens "
                         f"{cfg.optim.batch_tokens} than a step takes ({cfg.optim.accumulate} x {ranks.count} "
                         "processes): lower them, or prepare more rows")
    schedule = Schedule(cfg.optim.lr, cfg.optim.warmup_steps, cfg.budget.minutes * 60, cfg.budget.max_steps or (
        int(cfg.budget.epochs * steps_per_epoch) if cfg.budget.epochs else 0))
    log = RunLog(run, cfg.tensorboard, resume_step=state["step"], resume_bytes=state.get("log_bytes"),
                 writer=ranks.main)
    say(ranks, f"{len(data.rows)} train rows ({sum(lengths)} tokens), {len(data.val_rows)} val rows, "
               f"{steps_per_epoch} steps/epoch of {cfg.optim.accumulate} x {ranks.count} batches "
               f"({ranks.count} process{'es' if ranks.count > 1 else ''}); target features in {data.feature_s:.1f}s"
               + (f"; resuming at step {state['step']}" if state["step"] else ""))
    bar = tqdm(total=int(schedule.limit_s) if schedule.limit_s else schedule.max_steps,
               initial=int(state["train_s"]) if schedule.limit_s else state["step"],
               unit="s" if schedule.limit_s else "step", desc="train", dynamic_ncols=True, disable=not ranks.main,
               bar_format="{l_bar}{bar}| {n_fmt}/{total_fmt}{unit} [{elapsed}<{remaining}{postfix}]")
    last_save = last_val = state["train_s"]
    tok_window, t_window = 0, time.perf_counter()
    try:
        while schedule.progress(state) < 1.0:
            batches = make_batches(lengths, cfg.optim.batch_tokens,
                                   torch.Generator().manual_seed(cfg.seed * 7919 + state["epoch"]), groups)
            for b in range(state["batch_in_epoch"], steps_per_epoch):
                micro = [batches[b * per_step + a * ranks.count + ranks.index] for a in range(cfg.optim.accumulate)]
                m = train_step(cfg, head, optim, target, data, micro, schedule.lr_at(state), state, run, ranks)
                state["step"] += 1
                state["batch_in_epoch"] = b + 1
                state["train_s"] += m.pop("seconds")
                state["tokens"] += m["tokens_all"]
                tok_window += m.pop("tokens_all")
                bar.update(int(state["train_s"]) - bar.n if schedule.limit_s else 1)  # whole seconds
                if state["step"] % cfg.log_every == 0:
                    tps = tok_window / (time.perf_counter() - t_window)
                    tok_window, t_window = 0, time.perf_counter()
                    bar.set_postfix(loss=f"{m['loss']:.3f}", acc=f"{m['acc']:.3f}", tok_s=f"{tps:.0f}")
                    log.write({"step": state["step"], "lr": schedule.lr_at(state), "tok_s": round(tps), **m}, "train")
                if schedule.progress(state) >= 1.0:
                    break
                if cfg.eval.every_minutes > 0 and state["train_s"] - last_val >= cfg.eval.every_minutes * 60:
                    checkpoint_and_validate(cfg, head, optim, target, data, run, state, log, ranks, final=False)
                    last_val = last_save = state["train_s"]
                elif state["train_s"] - last_save >= cfg.save_every_minutes * 60:
                    state["log_bytes"] = log.mark()
                    if ranks.main:
                        save_checkpoint(run, head, optim, state)
                    ranks.barrier()
                    last_save = state["train_s"]
            else:
                state["epoch"] += 1
                state["batch_in_epoch"] = 0
        bar.close()
        checkpoint_and_validate(cfg, head, optim, target, data, run, state, log, ranks, final=True)
    finally:
        bar.close()
        log.close()
    return state


def train_step(cfg: TrainConfig, head, optim: Optim, target, data: TrainData, micro: list[list[int]], lr: float,
               state: dict, run: Path, ranks: Ranks = Ranks()) -> dict:
    """One optimizer step on this process's micro-batches `micro` (rows of each): their gradients averaged, and with
    several processes averaged over them too (`train.parallel.average_gradients`, which also sums the metrics and
    seconds, so every process sees the same). Returns the step's metrics (loss and accuracy: the means over the
    micro-batches), `tokens_all` (every process's) and `seconds` (their mean). A loss or gradient norm that is not
    finite on any process stops training on all of them with a TrainError naming the last good checkpoint, before
    the weights change; with float16 products a gradient that overflowed skips the step and lowers the loss scale
    instead (`torch.amp.GradScaler`)."""
    t0 = time.perf_counter()
    p0 = next(head.parameters())
    dev, dtype, A = p0.device, p0.dtype, len(micro)
    compute, scaler = optim.precision.compute, optim.scaler
    for g in optim.opt.param_groups:
        g["lr"] = lr
    optim.opt.zero_grad(set_to_none=True)
    sums, extra = [0.0, 0.0, 0.0, 0.0], {}  # loss, acc, tokens, non-finite losses; the last batch's other metrics
    for a, batch in enumerate(micro):
        ids, mask, f = collate(data.rows, data.feats, batch, target, data.layers, cfg.loss.positions == "all")
        # each micro-batch's noise depends on the step and its place in the step alone: exact resume, and the same
        # draws whatever the split between processes and accumulation
        gen = torch.Generator().manual_seed(cfg.seed * 1_000_003 + state["step"] * A * ranks.count
                                            + a * ranks.count + ranks.index)
        with torch.autocast(dev.type, dtype=compute or torch.bfloat16, enabled=compute is not None):
            loss, m = head_loss(head, ids.to(dev, non_blocking=True), mask.to(dev, non_blocking=True),
                                f.to(dev, dtype, non_blocking=True), cfg, gen)
        if not math.isfinite(m["loss"]):
            sums[3] += 1
            continue
        scaler.scale(loss / A if A > 1 else loss).backward()
        sums[0], sums[1], sums[2] = sums[0] + m["loss"], sums[1] + m["acc"], sums[2] + ids.numel()
        extra = {k: v for k, v in m.items() if k not in ("loss", "acc")}
    seconds = time.perf_counter() - t0
    total = average_gradients(optim.params, [*sums, seconds], ranks)
    where = f"at step {state['step']} (batch {state['batch_in_epoch']} of epoch {state['epoch']})"
    if total[3]:
        raise TrainError(f"loss is nan at step {state['step']} (batch {state['batch_in_epoch']} of epoch "
                         f"{state['epoch']}): training stopped; {last_good(run, state['step'])}")
    scaler.unscale_(optim.opt)
    if cfg.optim.grad_clip:
        norm = torch.nn.utils.clip_grad_norm_(optim.params, cfg.optim.grad_clip)
        if not math.isfinite(float(norm)) and not scaler.is_enabled():  # before the step: the weights stay finite
            raise TrainError(f"gradient norm is {float(norm)} {where}: training stopped; "
                             f"{last_good(run, state['step'])}")
    scaler.step(optim.opt)  # (fp16: skipped when a gradient overflowed; the next steps run at a lower scale)
    scaler.update()
    n = A * ranks.count
    return {"loss": total[0] / n, "acc": total[1] / n, **extra, "tokens_all": int(total[2]),
            "seconds": total[4] / ranks.count}


def checkpoint_and_validate(cfg: TrainConfig, head, optim: Optim, target, data: TrainData, run: Path, state: dict,
                            log: RunLog, ranks: Ranks, final: bool) -> None:
    """Validate (every process its share); the main process exports the head to `out` when its simulated tau is the
    best so far, then writes the checkpoint."""
    check_finite(head, run, state)
    v = validate(head, target, data.val_rows, data.val_feats, data.prompts, cfg, ranks, data.decode_target)
    score = v["val_sim_tau"]  # every held-out row, so far less noisy than decoding a few prompts
    best = score > state["best_tau"]
    if best:
        state["best_tau"] = score
    state["done"] = final
    rec = {"step": state["step"], "train_min": round(state["train_s"] / 60, 2), **v, "best": state["best_tau"]}
    log.write(rec, "val")
    state["log_bytes"] = log.mark()
    if ranks.main:
        if best:
            save_head(head, Path(cfg.out), extra={"step": state["step"], **v}, dtype=optim.precision.save)
        save_checkpoint(run, head, optim, state)
        tqdm.write("validation: " + ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}"
                                              for k, v in rec.items()))
    ranks.barrier()
