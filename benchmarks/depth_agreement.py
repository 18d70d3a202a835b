"""Does decoding lose anything at depth? A head's agreement with the target at each draft depth, teacher-forced
on held-out rows, next to chain decoding's acceptance at each position on the same rows' prompts.

    .venv/bin/python benchmarks/depth_agreement.py --draft runs/demo/head --prepared runs/demo/data --rows 8 --k 4

Teacher-forced, depth s: the head is unrolled s steps on its own predicted features (the training-time test's
attention, `train.losses.unrolled`, as the loss unrolls it) with the true tokens as inputs, over the held-out rows (the target's own
greedy text when they were regenerated). Depth s agrees at position p when the head's depth-s token equals the
target's argmax; the rate printed is conditional, as chain acceptance is: among positions where depths 1..s-1
agreed (in a chain, a draft is only checked when every draft before it was accepted).

Simulated: chain decoding with k drafts simulated along the same rows (`train.validate.simulated_accepts`, what
validation measures): rounds start only where decoding would start them, right after the target's own token.

Decoding: chain decoding with k drafts of the same rows' prompts (their first user turn), 128 new tokens; its
acceptance at position s is the fraction of rounds that accepted draft s among those that accepted drafts
1..s-1. The decoder and the rows see the same text, so the two columns should agree up to sampling noise; a
gap at depth > 1 would mean drafting does not reproduce what the head was trained on.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from eagle import EagleHead, load_target
from eagle.features import features_dir
from infer import SpeculativeDecoder
from infer.evaluate import load_prompts
from train.config import TrainConfig
from train.data import load_rows
from train.features import cached_features, target_features
from train.losses import head_inputs, unrolled
from train.validate import acceptance_stats, depth_counts, simulated_accepts


@torch.inference_mode()
def teacher_forced(head, target, rows, feats, depths: int) -> list[tuple[int, int]]:
    """(agreeing, checked) at each depth, conditional on the depths before it agreeing."""
    W = target.lm_head.weight
    H = head.config.hidden_size
    counts = [[0, 0] for _ in range(depths)]
    for (ids, mask), f in zip(rows, feats):
        ids, f = ids[None], f[None].to(W.dtype)
        truth = (f[0, 1:, :H] @ W.T).argmax(-1)[:-1]  # the target's token p + 2, from its feature p + 1
        scored = mask[2:]
        ok = [head.to_target_ids(head.logits(pred[0]).argmax(-1))[:-1] == truth
              for _, pred, _ in unrolled(head, head_inputs(head, f), ids[:, 1:], depths)]
        L = truth.shape[0]
        for s in range(depths):  # a chain drafted at position p checks depth j + 1 at position p + j
            for p in range(L - s):
                if all(scored[p + j] for j in range(s + 1)) and all(ok[j][p + j] for j in range(s)):
                    counts[s][1] += 1
                    counts[s][0] += int(ok[s][p + s])
    return [tuple(c) for c in counts]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default="smollm2-135m")
    ap.add_argument("--draft", required=True)
    ap.add_argument("--prepared", required=True, help="a directory written by `eagle prep` (its held-out rows)")
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--decode-rows", type=int, default=None,
                    help="prompts to decode (default: --rows; 0 prints the teacher-forced rates alone)")
    args = ap.parse_args()
    target = load_target(args.target)
    head = EagleHead.from_pretrained(args.draft).attach(target).eval()
    layers = list(head.config.feature_layer_ids) if head.config.head_type == "eagle3" else None
    cfg = TrainConfig()
    rows = load_rows(cfg, "val", args.prepared)
    # a feature file is matched on every row's length: without one, only the rows measured are passed (and
    # nothing is cached), so a few rows of a large held-out file cost a few rows' pass
    if args.rows < len(rows) and not features_dir(args.prepared, "val", target, layers).exists():
        rows = rows[: args.rows]
        feats = target_features(target, rows, "target features (val)", layers)
    else:
        feats = cached_features(target, rows, Path(args.prepared), "val", layers)
    tf = teacher_forced(head, target, rows[: args.rows], feats[: args.rows], args.k)
    sim = [a for row in simulated_accepts(head, target, rows[: args.rows], feats[: args.rows], args.k, 4096, layers)
           for a in row]
    sim_stats = acceptance_stats(sim, args.k)
    n_dec = args.rows if args.decode_rows is None else args.decode_rows
    prompts = load_prompts(str(Path(args.prepared) / "val_conversations.jsonl"), n_dec) if n_dec else []
    dec = SpeculativeDecoder(target, head)
    lengths = []
    for p in prompts:
        lengths += dec.generate(p["prompt"], args.max_new_tokens, num_speculative_tokens=args.k).accept_lengths
    dc, sc = depth_counts(lengths, args.k), depth_counts(sim, args.k)
    print("| depth | teacher-forced agreement | checked | simulated chain acceptance | rounds | decoding acceptance "
          "| rounds |")
    print("|---|---|---|---|---|---|---|")
    for s in range(args.k):
        print(f"| {s + 1} | {tf[s][0] / max(tf[s][1], 1):.3f} | {tf[s][1]} | {sc[s][0] / max(sc[s][1], 1):.3f} "
              f"| {sc[s][1]} | {dc[s][0] / max(dc[s][1], 1):.3f} | {dc[s][1]} |")
    print(json.dumps({"teacher_forced": [a / max(n, 1) for a, n in tf], "simulated": sim_stats["accept"],
                      "simulated_tau": sim_stats["tau"], "decoding": [a / max(n, 1) for a, n in dc],
                      "tau": (sum(lengths) + len(lengths)) / max(len(lengths), 1)}))


if __name__ == "__main__":
    main()
