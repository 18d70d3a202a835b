"""Rows, batches and the loader: the prepared rows read once, grouped into batches of similar length, and collated
by a `torch.utils.data.DataLoader` (worker processes, pinned memory, prefetch) into right-padded batches with their
cached target features in the store's dtype, so the host prepares the next batches while the device trains.

    data = load_data(cfg, target, ranks)                 # rows, features (train.features), held-out rows, prompts
    loader = BatchLoader(data.rows, data.feats, cfg, device)
    for batch in loader.epoch(batches, start):           # this process's micro-batches, in order
        batch.to(device)                                 # ids [B, T], loss mask [B, T], features [B, T, W]
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from data_prep import iter_examples
from eagle import TargetModel
from eagle.features import FeatureStore
from eagle.head import eagle3_layers
from train.config import TrainConfig, TrainError
from train.features import batch_features, cached_features, feature_pass_target
from train.parallel import Ranks


def load_rows(cfg: TrainConfig, split: str, prepared: str) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(ids, loss mask) of each row of `prepared/split.jsonl`, cut to data.max_length: ids in int32 (4 bytes a
    token; a million rows of 1,000 tokens hold 4 GB, and each batch widens its own), read a line at a time."""
    path = Path(prepared) / f"{split}.jsonl"
    if not path.exists():
        raise TrainError(f"prepared data {str(path)!r} does not exist: run `eagle prep --out {prepared}` first")
    rows = []
    for ex in iter_examples(path):
        ids = torch.tensor(ex.input_ids[: cfg.data.max_length], dtype=torch.int32)
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


@dataclass
class Batch:
    """Right-padded rows: ids [B, T] (long), the loss mask [B, T] (bool: the scored positions), and their cached
    target features [B, T, W] in the store's dtype (None when the target computes them per batch, data.online)."""

    ids: torch.Tensor
    mask: torch.Tensor
    feats: torch.Tensor | None

    def pin_memory(self) -> "Batch":  # (the DataLoader pins what a batch holds, for copies that overlap the step)
        return Batch(self.ids.pin_memory(), self.mask.pin_memory(),
                     None if self.feats is None else self.feats.pin_memory())

    def to(self, device: torch.device) -> "Batch":
        """On `device`, copied without waiting (from pinned memory the copy overlaps the device's work)."""
        return Batch(self.ids.to(device, non_blocking=True), self.mask.to(device, non_blocking=True),
                     None if self.feats is None else self.feats.to(device, non_blocking=True))


class Batches(torch.utils.data.Dataset):
    """A batch by its row indices (a tuple): what the loader's workers collate. With `all_positions` the mask is
    every real (unpadded) position (loss.positions all)."""

    def __init__(self, rows, feats: FeatureStore | None, all_positions: bool = False):
        self.rows, self.feats, self.all_positions = rows, feats, all_positions

    def __getitem__(self, idx) -> Batch:
        rows = self.rows
        T, B = max(rows[i][0].shape[0] for i in idx), len(idx)
        ids = torch.zeros(B, T, dtype=torch.long)
        mask = torch.zeros(B, T, dtype=torch.bool)
        for b, i in enumerate(idx):
            n = rows[i][0].shape[0]
            ids[b, :n], mask[b, :n] = rows[i][0], True if self.all_positions else rows[i][1]
        if self.feats is None:
            return Batch(ids, mask, None)
        parts = [self.feats[i] for i in idx]
        f = torch.zeros(B, T, parts[0].shape[-1], dtype=functools.reduce(torch.promote_types, (p.dtype for p in parts)))
        for b, p in enumerate(parts):
            f[b, : p.shape[0]] = p
        return Batch(ids, mask, f)

    def __len__(self) -> int:  # (keys are row tuples; the sampler gives them)
        return len(self.rows)


def collate(rows, feats: FeatureStore | None, idx: list[int], target: TargetModel | None = None,
            layers: list[int] | None = None, all_positions: bool = False) -> Batch:
    """The Batch of rows `idx`, in this process; without cached `feats` the target computes the features now
    (online training, validation)."""
    batch = Batches(rows, feats, all_positions)[tuple(idx)]
    if batch.feats is None and target is not None:
        batch.feats = batch_features(target, batch.ids, layers)
    return batch


class EpochBatches(torch.utils.data.Sampler):
    """The batches (row tuples) one epoch serves this process, in order; set anew each epoch, so a loader with
    persistent workers serves the whole run."""

    def __init__(self):
        self.batches: list[tuple[int, ...]] = []

    def __iter__(self):
        return iter(self.batches)

    def __len__(self) -> int:
        return len(self.batches)


def default_workers(cfg: TrainConfig, device: torch.device) -> int:
    """data.workers, or (-1) what measured fastest: 0 on a CPU (2 cores: a worker takes a core from the step;
    BENCHMARKS.md), 4 on a GPU (the host collates and reads features while the device trains)."""
    return cfg.data.workers if cfg.data.workers >= 0 else (4 if device.type == "cuda" else 0)


class BatchLoader:
    """The run's DataLoader over `Batches`: `epoch(batches)` yields them collated, from `workers` processes that
    read and pad ahead (prefetch 4 each) into pinned memory on CUDA, or in this process with none."""

    def __init__(self, rows, feats: FeatureStore | None, cfg: TrainConfig, device: torch.device):
        workers = default_workers(cfg, device)
        self.sampler = EpochBatches()
        self.loader = torch.utils.data.DataLoader(
            Batches(rows, feats, cfg.loss.positions == "all"), batch_size=None, sampler=self.sampler,
            num_workers=workers, pin_memory=device.type == "cuda", prefetch_factor=4 if workers else None,
            persistent_workers=workers > 0)

    def epoch(self, batches: list[list[int]]) -> Iterator[Batch]:
        self.sampler.batches = [tuple(b) for b in batches]
        return iter(self.loader)


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


def load_data(cfg: TrainConfig, target: TargetModel, ranks: Ranks = Ranks()) -> TrainData:
    """The prepared rows of `data.prepared` and `data.extra`, their target features (cached beside the rows; a
    missing store computed by every process, each its share: `train.features`), the held-out rows and prompts;
    training rows that repeat a held-out row are left out. A target loaded without its decoder layers is loaded
    whole only if some features are missing (`TargetModel.whole`, once)."""
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
        tokens = cfg.data.pass_tokens
        feats = FeatureStore.concat([cached_features(target, part, Path(src), "train", layers, dtype, other, ranks,
                                                     tokens) for src, part in zip(sources, parts)])
        # held-out rows always by the target itself: the simulated tau they give equals real decoding's
        val_feats = cached_features(target, val_rows, Path(cfg.data.prepared), "val", layers, dtype, whole, ranks,
                                    tokens)
    feature_s = time.perf_counter() - t0
    sources = [s for s, part in enumerate(parts) for _ in part]
    keep = repeat_free(rows, val_rows, cfg.data.val_overlap)
    leaked = len(rows) - len(keep)
    if leaked:
        rows, sources = [rows[i] for i in keep], [sources[i] for i in keep]
        feats = None if feats is None else feats.take(keep)
    if leaked and ranks.main:
        rule = "identical" if cfg.data.val_overlap > 1 else \
            f"identical, or holding >= {cfg.data.val_overlap:.0%} of its reply's 8-grams"
        print(f"left out {leaked} training rows that repeat a validation row of {cfg.data.prepared} ({rule})")
    prompts = val_prompts(cfg)
    return TrainData(rows, feats, val_rows, val_feats, layers, prompts, feature_s, sources,
                     whole if prompts else None)




def val_prompts(cfg: TrainConfig) -> list[str]:
    from infer import load_prompts

    path = Path(cfg.data.prepared) / "val_conversations.jsonl"
    if not path.exists() or cfg.eval.num_prompts <= 0:
        return []
    return [p["prompt"] for p in load_prompts(str(path), cfg.eval.num_prompts)]
