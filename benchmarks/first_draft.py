"""Where first drafts are lost: a head's first-draft agreement with the target on the target's own greedy replies,
beside the two things that cap it: the share of reply tokens inside the head's draft vocabulary (a first draft can
be accepted only there) and how sure the target is of its token; then the share a draft vocabulary of each size
would hold of held-out regenerated replies.

    .venv/bin/python benchmarks/first_draft.py --head runs/curve2/all/14/head --data runs/demo/data \
        --heldout runs/demo/extra

Replies: greedy, `--max-new-tokens`, to `--num-prompts` MT-bench prompts spread over the file and as many ShareGPT
first turns from `--skip-rows` on (rows the demo's data does not reach), each with the target's chat template.
Agreement is teacher-forced: the head reads the target's true features, as in the first draft of a round, and its
top 1 / 2 / 3 draft tokens are compared with the target's next token (a reply's first token is the prefill's, so
scoring starts at its second). Coverage by size: `data_prep.draft_vocabulary` chosen as training chooses it (the
counts of `--data`'s training rows, with ShareGPT's replies counted too) and measured on the assistant tokens of
`--heldout`'s rows. Prints one JSON line per part.
"""

from __future__ import annotations

import argparse
import importlib
import json
from pathlib import Path

import torch

from data_prep.prep import load_examples
from data_prep.sources import load_conversations
from data_prep.vocab import draft_vocabulary
from eagle import load_target
from eagle.head import load_head
from infer import SpeculativeDecoder
from infer.evaluate import load_prompts

regenerate = importlib.import_module("data_prep.regenerate")  # the module (the package exports a function by its name)
MT_BENCH = Path(__file__).resolve().parents[1].parent / "shared" / "evaldata" / "mt_bench.jsonl"


def greedy_replies(target, texts: list[str], max_new_tokens: int) -> list[tuple[list[int], "regenerate.Reply"]]:
    """(prompt ids, reply with features) for each user text that fits in 1,024 prompt tokens, the text rendered as
    `eagle eval` renders it (`SpeculativeDecoder.encode`: one user turn in the target's chat template)."""
    tok = target.tokenizer
    encode = SpeculativeDecoder(target, None).encode
    prompts = [p for p in map(encode, texts) if len(p) <= 1024]
    pad = tok.pad_token_id if tok.pad_token_id is not None else target.eos_ids[0]
    replies = regenerate.greedy_replies(target, prompts, max_new_tokens, 64, pad, set(target.eos_ids),
                                        keep_features=True)
    return list(zip(prompts, replies))


@torch.no_grad()
def first_draft_stats(head, target, replies) -> dict:
    """Teacher-forced top-1/2/3 agreement (top-1 also by how sure the target is), draft-vocabulary coverage and p's
    top probability over reply tokens 2..N."""
    in_vocab = torch.zeros(target.vocab_size, dtype=torch.bool)
    in_vocab[head.d2t if head.config.draft_vocab_size else slice(None)] = True
    hits, p_top, top1, held, n = torch.zeros(3), [], [], [], 0
    for prompt, reply in replies:
        ids, f = torch.tensor(prompt + reply.new_ids), reply.features  # f [P + N, H]: f[t] gives token t + 1
        P, N = len(prompt), len(reply.new_ids)
        if N < 2:
            continue
        # the head at t reads (f[t], ids[t + 1]) and drafts token t + 2; scored where t + 2 is reply token 2..N
        t = torch.arange(P - 1, P + N - 2)
        hidden = head(f[None, :-1], ids[None, 1:], torch.arange(len(ids) - 1)[None])[0, t]
        top3 = head.to_target_ids(head.logits(hidden).topk(3, dim=-1).indices)
        want = ids[t + 2]
        agree = (top3 == want[:, None]).cumsum(-1).clamp(max=1)
        hits += agree.sum(0).float()
        top1.append(agree[:, 0].float())
        held.append(in_vocab[want].float())
        p_top.append(torch.softmax(target.logits(f[t + 1]).float(), -1).amax(-1))
        n += len(t)
    p_top, top1, held = torch.cat(p_top), torch.cat(top1), torch.cat(held)
    # where the target is unsure, fairly sure and sure of its token: top-1 agreement, and the draft vocabulary's share
    bands = {}
    for lo, hi in ((0.0, 0.5), (0.5, 0.9), (0.9, 1.01)):
        band = (p_top >= lo) & (p_top < hi)
        bands[f"p_top_{lo}_{hi}"] = {"share": round(float(band.float().mean()), 4),
                                     "top1": round(float(top1[band].mean()), 4),
                                     "in_draft_vocab": round(float(held[band].mean()), 4)}
    return {**bands, "tokens": n, "top1": round(float(hits[0]) / n, 4), "top2": round(float(hits[1]) / n, 4),
            "top3": round(float(hits[2]) / n, 4), "in_draft_vocab": round(float(held.mean()), 4),
            "p_top_mean": round(float(p_top.mean()), 4)}


def coverage_by_size(target, data: Path, heldout: Path, sizes: list[int], count_rows: int) -> dict:
    """The share of `heldout`'s assistant tokens inside the draft vocabulary of each size chosen on `data`."""
    def rows(path):
        return [(torch.tensor(e.input_ids), torch.tensor(e.loss_mask, dtype=torch.bool))
                for e in load_examples(path / "train.jsonl")]
    train_rows, held = rows(data), rows(heldout)
    tokens = torch.cat([ids[mask] for ids, mask in held])
    out = {"heldout_tokens": tokens.numel()}
    for n in sizes:
        vocab = draft_vocabulary(train_rows, target.vocab_size, n, target.tokenizer, "sharegpt", count_rows)
        out[str(n)] = 1.0 if vocab is None else round(float(torch.isin(tokens, vocab).float().mean()), 4)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--head", required=True)
    ap.add_argument("--target", default="smollm2-135m")
    ap.add_argument("--data", default="runs/demo/data", help="the head's prepared rows (its vocabulary's counts)")
    ap.add_argument("--heldout", default="runs/demo/extra", help="regenerated rows the head never trained on")
    ap.add_argument("--num-prompts", type=int, default=20)
    ap.add_argument("--skip-rows", type=int, default=9000)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--sizes", type=int, nargs="+", default=[2048, 4096, 8192, 16384, 32768])
    ap.add_argument("--count-rows", type=int, default=6000, help="as model.vocab_count_rows")
    args = ap.parse_args()
    target = load_target(args.target)
    head = load_head(args.head, target=target).attach(target)
    mt = [p["prompt"] for p in load_prompts(str(MT_BENCH), args.num_prompts, spread=True)]
    convs, _ = load_conversations("sharegpt", max_rows=3 * args.num_prompts, skip_rows=args.skip_rows)
    sharegpt = [c[0]["content"] for c in convs if c and c[0]["role"] == "user"][: 2 * args.num_prompts]
    for name, texts in (("mt_bench", mt), ("sharegpt", sharegpt)):
        stats = first_draft_stats(head, target, greedy_replies(target, texts, args.max_new_tokens))
        print(json.dumps({"part": name, **stats}), flush=True)
    print(json.dumps({"part": "coverage_by_size", **coverage_by_size(target, Path(args.data), Path(args.heldout),
                                                                      args.sizes, args.count_rows)}))


if __name__ == "__main__":
    main()
