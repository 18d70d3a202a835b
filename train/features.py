"""The target features training reads: cached beside the prepared rows (eagle.features), computed once by a pass
of the target that every process shares, or per batch (data.online).

    store = cached_features(target, rows, prepared, "train", layers, dtype, pass_target, ranks)

With N processes each computes the batches i with i % N == its index, of the same length-sorted batches one process
would run (so each row's features are the very ones one process computes), into its own shards; the main process
then writes the one index of them all. No process waits for the length of the pass: N processes take 1/N of it.
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Callable
from pathlib import Path

import torch
from tqdm import tqdm

from eagle import TargetModel, load_target
from eagle.device import native_bfloat16
from eagle.features import (FeatureError, FeatureStore, FeatureWriter, check_room, default_dtype, features_dir,
                            join_parts)
from eagle.memory import TargetSize
from train.config import TrainConfig
from train.parallel import Ranks
from train.plan import check_pass_fits



def cached_features(target: TargetModel, rows, prepared: Path, split: str, layers: list[int] | None = None,
                    dtype: torch.dtype | None = None, pass_target: Callable[[], TargetModel] | None = None,
                    ranks: Ranks = Ranks(), pass_tokens: int = 4096) -> FeatureStore:
    """Target features of every row, kept in `dtype` (None: any dtype a complete store of the target's is in, else
    the target's) in a store beside the prepared rows (eagle.features: shards written as they are computed, read a
    row at a time) so later runs on the same data skip the pass; prep leaves them there when regeneration computed
    them already. Its size is printed, and checked against the free disk, before anything is written; a pass killed
    midway resumes after its last complete shard. Every process of a run calls it, and shares the pass.

    `pass_target` (a callable returning a TargetModel: `target` with its layers, or a bfloat16 copy) computes the
    features when `target` has none stored for these rows (default: `target.whole()`); a store is keyed by the
    identity of the target that computed it, so a copy's never passes for `target`'s. The pass runs batches of
    about `pass_tokens` padded tokens (data.pass_tokens)."""
    lengths = [r[0].shape[0] for r in rows]
    store = _stored_features(target, lengths, prepared, split, layers, dtype, ranks)
    if store is None:
        if not target.has_layers:  # the whole target is to load: refuse, in one line, one the device cannot hold
            check_pass_fits(TargetSize.of_module(target.model), target.device, target.dtype.itemsize,
                            target.hidden_size * (1 + len(layers or [])))
        computing = (pass_target or target.whole)()
        if computing.identity != target.identity:
            store = _stored_features(computing, lengths, prepared, split, layers, dtype, ranks)
        target = computing
    dtype = dtype or default_dtype(target.dtype)
    folder = features_dir(prepared, split, target, layers, dtype)
    if store is None:
        width = target.hidden_size * (1 + len(layers or []))
        with FeatureWriter(folder, lengths, width, dtype, part=ranks.index if ranks.count > 1 else None) as w:
            ranks.barrier()  # every part has read what is done before any writes
            todo = w.missing()
            size = sum(lengths[i] for i in todo) * width * dtype.itemsize
            if ranks.main:
                print(f"target features ({split}): {sum(lengths):,} tokens x {width} "
                      f"{str(dtype).removeprefix('torch.')} = {sum(lengths) * width * dtype.itemsize / 2**20:,.1f} "
                      f"MiB in {folder}" + (f" ({len(lengths) - len(todo)} rows there already)"
                                           if len(todo) < len(lengths) else "")
                      + (f"; {ranks.count} processes share the pass" if ranks.count > 1 else ""))
            check_room(folder, size, f"target features ({split})")
            target_features(target, rows, todo, w, f"target features ({split})", layers, ranks, pass_tokens)
        if ranks.count > 1:
            ranks.barrier()
            if ranks.main:
                join_parts(folder, lengths, width, dtype)
            ranks.barrier()
        store = FeatureStore.open(folder, lengths)
    if store is None:  # written whole just now, yet unreadable: the disk or another writer, not this pass
        raise FeatureError(f"target features ({split}): the store in {str(folder)!r} was written but cannot be read "
                           "back; check the disk, delete the folder and run again")
    return store


def _stored_features(target: TargetModel, lengths: list[int], prepared: Path, split: str, layers: list[int] | None,
                     dtype: torch.dtype | None, ranks: Ranks = Ranks()) -> FeatureStore | None:
    """`target`'s complete store of these rows in `dtype` (None: in its own dtype, or any other), or, for a 16-bit
    `dtype`, its float32 one converted (by the main process), or None. Every process looks before any writes."""
    ranks.barrier()
    if dtype is None:
        kinds = dict.fromkeys([default_dtype(target.dtype), torch.float32, torch.bfloat16, torch.float16])
        found = (FeatureStore.open(features_dir(prepared, split, target, layers, d), lengths) for d in kinds)
        store = next((s for s in found if s is not None), None)
        ranks.barrier()
        return store
    folder = features_dir(prepared, split, target, layers, dtype)
    store = FeatureStore.open(folder, lengths)
    # a float32 store of the same rows, converted
    wide = FeatureStore.open(features_dir(prepared, split, target, layers), lengths) \
        if store is None and dtype != torch.float32 else None
    ranks.barrier()
    if wide is not None:
        if ranks.main:
            check_room(folder, sum(lengths) * wide.width * dtype.itemsize, f"target features ({split})")
            with FeatureWriter(folder, lengths, wide.width, dtype) as w:
                for i in w.missing():
                    w.add(i, wide[i])
        ranks.barrier()
        store = FeatureStore.open(folder, lengths)
    return store


@torch.inference_mode()
def batch_features(target: TargetModel, ids: torch.Tensor, layers: list[int] | None = None) -> torch.Tensor:
    """[B, T, H] post-norm last hidden states of right-padded rows, with the `layers` appended ([B, T, (1+n)H]), on
    the target's device in its dtype."""
    last, aux = target.hidden(ids.to(target.device), layers=layers)
    return last if aux is None else torch.cat([last, aux], dim=-1)


def pass_batches(rows, todo: list[int], pass_tokens: int = 4096) -> list[list[int]]:
    """The rows `todo` sorted by length, in batches of about `pass_tokens` padded tokens."""
    order = sorted(todo, key=lambda i: rows[i][0].shape[0])
    batches, i = [], 0
    while i < len(order):
        j = i + max(1, pass_tokens // rows[order[i]][0].shape[0])
        batches.append(order[i:j])
        i = j
    return batches


@torch.inference_mode()
def target_features(target: TargetModel, rows, todo: list[int], writer: FeatureWriter, desc: str,
                    layers: list[int] | None = None, ranks: Ranks = Ranks(), pass_tokens: int = 4096) -> None:
    """Run the target over this process's share of the rows `todo` (every `ranks.count`-th of their batches) and
    hand their post-norm last hidden states (followed by the `layers` an EAGLE-3 head reads) to `writer`, which
    writes them shard by shard: one copy to the host a batch, in the store's dtype."""
    mine = pass_batches(rows, todo, pass_tokens)[ranks.index::ranks.count]
    bar = tqdm(total=sum(rows[k][0].shape[0] for idx in mine for k in idx), desc=desc, unit="tok",
               dynamic_ncols=True, disable=not ranks.main)
    for idx in mine:
        T = max(rows[k][0].shape[0] for k in idx)
        ids = torch.zeros(len(idx), T, dtype=torch.long)
        for b, k in enumerate(idx):
            ids[b, : rows[k][0].shape[0]] = rows[k][0]  # right padding: causal attention keeps rows intact
        feats = batch_features(target, ids, layers).to("cpu", writer.dtype)
        for b, k in enumerate(idx):
            writer.add(k, feats[b, : rows[k][0].shape[0]])
        bar.update(sum(rows[k][0].shape[0] for k in idx))
    bar.close()


def feature_pass_target(cfg: TrainConfig, target: TargetModel,
                        whole: Callable[[], TargetModel] | None = None) -> Callable[[], TargetModel] | None:
    """None when `data.feature_pass` leaves the feature pass to the target as loaded; else a callable that makes (once,
    when a store is missing) the bfloat16 copy of the target (of `whole()`, the target with its layers: default
    `target.whole`) that computes it."""
    whole = whole or target.whole
    want = cfg.data.feature_pass
    if want == "target" or target.dtype == torch.bfloat16 or (want == "auto" and not native_bfloat16(target.device)):
        return None

    def in_bfloat16() -> TargetModel:
        if target.checkpoint is not None:  # its files, loaded again in bfloat16: no float32 copy on the way
            return load_target(target.name, target.device, torch.bfloat16)
        return TargetModel(target.name, copy.deepcopy(whole().model).to(torch.bfloat16), target.tokenizer,
                           target.source)

    return functools.cache(in_bfloat16)
