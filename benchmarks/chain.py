"""Chain speculative decoding vs plain greedy vs transformers' prompt lookup, all in one run on the same prompts.

    .venv/bin/python benchmarks/chain.py --draft runs/demo/head --data ../shared/evaldata/mt_bench.jsonl \
        --num-prompts 20 --max-new-tokens 128 --k 2 3 4 5 6

For every prompt, each method runs back to back (so machine noise hits them alike). Prints a Markdown table and,
as its last line, a JSON object with every number.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from eagle import load_target
from eagle.fastlinear import disable_fast_linear
from infer import SpeculativeDecoder
from infer.evaluate import load_prompts


def hf_generate(target, ids: list[int], n: int, lookup: int = 0) -> tuple[list[int], float]:
    disable_fast_linear(target.model)  # transformers as users run it; our decoder re-enables its layouts
    x = torch.tensor([ids])
    kw = {"prompt_lookup_num_tokens": lookup} if lookup else {}
    t0 = time.perf_counter()
    out = target.model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=n, do_sample=False,
                                pad_token_id=target.tokenizer.pad_token_id, eos_token_id=target.eos_ids, **kw)
    return out[0, len(ids):].tolist(), time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--target", default="smollm2-135m")
    ap.add_argument("--draft", required=True)
    ap.add_argument("--data", default="../shared/evaldata/mt_bench.jsonl")
    ap.add_argument("--num-prompts", type=int, default=20)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--k", type=int, nargs="+", default=[2, 3, 4, 5, 6])
    ap.add_argument("--lookup", type=int, default=10, help="prompt_lookup_num_tokens for transformers")
    args = ap.parse_args()

    target = load_target(args.target)
    dec = SpeculativeDecoder.from_pretrained(target, args.draft)
    prompts = load_prompts(args.data, args.num_prompts)
    n = args.max_new_tokens
    methods = ["engine_greedy", "hf_generate", "hf_prompt_lookup"] + [f"chain_k{k}" for k in args.k]
    tokens = {m: 0 for m in methods}
    seconds = {m: 0.0 for m in methods}
    rounds = {k: [0, 0] for k in args.k}  # emitted, verify passes
    same = {m: 0 for m in methods}
    warm = dec.encode(prompts[0]["prompt"])
    dec.generate(warm, 8, speculative=False)
    dec.generate(warm, 8, num_speculative_tokens=args.k[0])
    hf_generate(target, warm, 8)
    for i, p in enumerate(prompts):
        ids = dec.encode(p["prompt"])
        base = dec.generate(ids, n, speculative=False)
        ref = base.token_ids
        runs = {"engine_greedy": (ref, base.total_s)}
        runs["hf_generate"] = hf_generate(target, ids, n)
        runs["hf_prompt_lookup"] = hf_generate(target, ids, n, args.lookup)
        for k in args.k:
            out = dec.generate(ids, n, num_speculative_tokens=k)
            runs[f"chain_k{k}"] = (out.token_ids, out.total_s)
            rounds[k][0] += sum(out.accept_lengths) + out.rounds
            rounds[k][1] += out.rounds
        for m, (toks, s) in runs.items():
            tokens[m] += len(toks)
            seconds[m] += s
            same[m] += toks == ref
        print(f"[{i + 1}/{len(prompts)}] " + ", ".join(f"{m} {len(t) / s:.1f}" for m, (t, s) in runs.items()),
              flush=True)
    tps = {m: tokens[m] / seconds[m] for m in methods}
    result = {
        "target": args.target, "draft": args.draft, "data": args.data, "num_prompts": len(prompts),
        "max_new_tokens": n, "threads": torch.get_num_threads(),
        "tokens_per_s": tps,
        "speedup_vs_engine_greedy": {m: tps[m] / tps["engine_greedy"] for m in methods},
        "tau": {f"chain_k{k}": e / max(r, 1) for k, (e, r) in rounds.items()},
        "identical_to_engine_greedy": {m: same[m] / len(prompts) for m in methods},
    }
    print()
    print("| method | tau | tokens/s | speedup vs our greedy | identical to greedy |")
    print("|---|---|---|---|---|")
    for m in methods:
        tau = result["tau"].get(m)
        print(f"| {m} | {'' if tau is None else f'{tau:.2f}'} | {tps[m]:.1f} | "
              f"{result['speedup_vs_engine_greedy'][m]:.2f}x | {result['identical_to_engine_greedy'][m]:.2f} |")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
