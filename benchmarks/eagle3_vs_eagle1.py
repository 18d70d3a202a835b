"""EAGLE-1 (full vocabulary), EAGLE-1 (reduced draft vocabulary) and EAGLE-3 heads under the same data and CPU
budget, evaluated on the same prompts in one process.

    .venv/bin/python benchmarks/eagle3_vs_eagle1.py --minutes 60 --data ../shared/evaldata/mt_bench.jsonl \
        --data ../shared/evaldata/gsm8k.jsonl --num-prompts 20

1. prepares regenerated ShareGPT rows once (`--rows`, reused when the same prep already ran), or uses the
   rows of `--prepared DIR` (written by `eagle prep`);
2. trains each head for `--minutes` (presets configs/smollm2-135m-eagle{1,3}.yaml, `--draft-vocab` for the
   reduced ones, `--override HEAD:key=value` for one head's settings; runs resume if killed);
3. on every prompt of every `--data` file: plain greedy once, then each head in chain mode (`--k`) and as a
   dynamic tree (`--dynamic TOP_K,DEPTH,TOTAL`); tau, per-position acceptance, speedup over greedy, and draft ms
   per step (drafting time / drafted levels).
Prints a Markdown table and, as its last line, a JSON object keyed `eagle1`, `eagle1_reduced`, `eagle3`, each with
`tau`, `speedup` and `draft_ms_per_step` (chain mode, all prompts), plus everything per file and mode.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from data_prep.prep import PrepConfig, prepare
from eagle import EagleHead, load_target
from eagle.configio import load_config
from infer import SpeculativeDecoder
from infer.evaluate import acceptance_per_position, load_prompts
from train.config import TrainConfig
from train.loop import train

HEADS = {  # name -> (preset, reduced draft vocabulary?)
    "eagle1": ("configs/smollm2-135m-eagle1.yaml", False),
    "eagle1_reduced": ("configs/smollm2-135m-eagle1.yaml", True),
    "eagle3": ("configs/smollm2-135m-eagle3.yaml", True),
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--minutes", type=float, required=True, help="training budget per head")
    ap.add_argument("--data", action="append", required=True, help="prompt file(s) in the evaldata format")
    ap.add_argument("--num-prompts", type=int, default=20)
    ap.add_argument("--spread", action="store_true", help="prompts evenly spaced over the file, not its first ones")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--rows", type=int, default=320, help="ShareGPT rows to regenerate for training")
    ap.add_argument("--prepared", help="train on this prepared directory instead of regenerating --rows")
    ap.add_argument("--draft-vocab", type=int, default=4096)
    ap.add_argument("--override", action="append", default=[], metavar="HEAD:KEY=VALUE",
                    help="a config override for one head, e.g. eagle3:loss.steps=2")
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--dynamic", default="2,3,4", metavar="TOP_K,DEPTH,TOTAL")
    ap.add_argument("--out", default="runs/eagle3_vs_eagle1")
    ap.add_argument("--heads", nargs="*", default=list(HEADS))
    args = ap.parse_args()
    out = Path(args.out)
    target = load_target("smollm2-135m")

    # 1. data, once
    data = Path(args.prepared) if args.prepared else out / "data"
    if not args.prepared:
        prepare(PrepConfig(target="smollm2-135m", data="sharegpt", out=str(data), max_rows=args.rows,
                           regenerate=True, max_turns=1, max_new_tokens=192, max_length=448, regen_batch_size=128),
                target=target)
    overrides = {name: [o.split(":", 1)[1] for o in args.override if o.split(":", 1)[0] == name] for name in HEADS}
    unknown = [o for o in args.override if o.split(":", 1)[0] not in HEADS or ":" not in o]
    if unknown:
        raise SystemExit(f"--override {unknown[0]!r}: expected HEAD:KEY=VALUE with HEAD one of {', '.join(HEADS)}")
    # 2. heads, same budget each
    for name in args.heads:
        preset, reduced = HEADS[name]
        cfg = load_config(TrainConfig, preset, [
            f"data.prepared={data}", f"run_dir={out / name / 'train'}", f"out={out / name / 'head'}",
            f"budget.minutes={args.minutes}", f"model.draft_vocab={args.draft_vocab if reduced else 0}",
            *overrides[name]])
        train(cfg, target=target)

    # 3. the same prompts for every head
    top_k, depth, total = (int(x) for x in args.dynamic.split(","))
    modes = {"chain": dict(mode="chain", num_speculative_tokens=args.k),
             "dynamic": dict(mode="dynamic", top_k=top_k, depth=depth, total_tokens=total)}
    decs = {name: SpeculativeDecoder(target, EagleHead.from_pretrained(out / name / "head")) for name in args.heads}
    files = {Path(f).stem: load_prompts(f, args.num_prompts, args.spread) for f in args.data}
    acc = {(n, f, m): {"tokens": 0, "s": 0.0, "accept": [], "draft_s": 0.0, "levels": 0, "same": 0}
           for n in decs for f in files for m in modes}
    base = {f: {"tokens": 0, "s": 0.0} for f in files}
    warm = next(iter(files.values()))[0]["prompt"]
    for dec in decs.values():
        dec.generate(warm, 8, speculative=False)
        for kw in modes.values():
            dec.generate(warm, 8, **kw)
    for f, prompts in files.items():
        for i, p in enumerate(prompts):
            ref = next(iter(decs.values())).generate(p["prompt"], args.max_new_tokens, speculative=False)
            base[f]["tokens"] += len(ref.token_ids)
            base[f]["s"] += ref.total_s
            for n, dec in decs.items():
                for m, kw in modes.items():
                    o = dec.generate(p["prompt"], args.max_new_tokens, **kw)
                    a = acc[(n, f, m)]
                    a["tokens"] += len(o.token_ids)
                    a["s"] += o.total_s
                    a["accept"] += o.accept_lengths
                    a["draft_s"] += o.draft_s
                    a["levels"] += o.rounds * (args.k if m == "chain" else depth)
                    a["same"] += o.token_ids == ref.token_ids
            print(f"[{f} {i + 1}/{len(prompts)}]", flush=True)

    def summary(keys) -> dict:
        tokens = sum(acc[k]["tokens"] for k in keys)
        s = sum(acc[k]["s"] for k in keys)
        accept = [a for k in keys for a in acc[k]["accept"]]
        btok = sum(base[k[1]]["tokens"] for k in keys)
        bs = sum(base[k[1]]["s"] for k in keys)
        n_prompts = sum(len(files[k[1]]) for k in keys)
        return {"tau": (sum(accept) + len(accept)) / max(len(accept), 1),
                "speedup": (tokens / s) / (btok / bs),
                "draft_ms_per_step": 1e3 * sum(acc[k]["draft_s"] for k in keys)
                / max(sum(acc[k]["levels"] for k in keys), 1),
                "acceptance_per_position": acceptance_per_position(accept, max(args.k, depth)),
                "lossless": sum(acc[k]["same"] for k in keys) / max(n_prompts, 1)}

    result = {n: {**summary([(n, f, "chain") for f in files]),
                  "per_file": {f: {m: summary([(n, f, m)]) for m in modes} for f in files}} for n in decs}
    result["settings"] = {"minutes": args.minutes, "rows": args.rows, "prepared": args.prepared,
                          "draft_vocab": args.draft_vocab, "overrides": args.override,
                          "k": args.k, "dynamic": args.dynamic, "num_prompts": args.num_prompts,
                          "spread": args.spread, "max_new_tokens": args.max_new_tokens, "data": args.data}
    print("| head | file | mode | tau | speedup | draft ms/step | lossless |")
    print("|---|---|---|---|---|---|---|")
    for n in decs:
        for f in files:
            for m in modes:
                r = result[n]["per_file"][f][m]
                print(f"| {n} | {f} | {m} | {r['tau']:.2f} | {r['speedup']:.2f}x | {r['draft_ms_per_step']:.1f} | "
                      f"{r['lossless']:.2f} |")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
