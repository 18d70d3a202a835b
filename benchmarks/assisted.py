"""A draft model on our engine against transformers' assisted generation with the same draft model, in one run on
the same prompts, beside plain greedy decoding on both.

    .venv/bin/python benchmarks/assisted.py --target smollm2-135m --draft-model smollm2-135m --num-prompts 6 --k 1 2

Offline the only draft model sharing a target's tokenizer here is the target itself: every draft is then accepted
(tau = k + 1 on our engine) and each round costs k + 1 target-sized passes, so both engines run slower than plain
decoding; the comparison is of the engines on the same work. With a network, pass a smaller model of the same
family (e.g. SmolLM2-135M-Instruct drafting for SmolLM2-1.7B-Instruct). Prints a Markdown table and, as its last
line, a JSON object with every number.
"""

from __future__ import annotations

import argparse
import json

from chain import hf_generate  # benchmarks/chain.py: transformers' generate (and assisted) as users run it
from eagle import load_target
from infer import SpeculativeDecoder
from infer.evaluate import load_prompts


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--target", default="smollm2-135m")
    ap.add_argument("--draft-model", default="smollm2-135m")
    ap.add_argument("--data", default="../shared/evaldata/mt_bench.jsonl")
    ap.add_argument("--num-prompts", type=int, default=6)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--k", type=int, nargs="+", default=[1, 2])
    args = ap.parse_args()
    target = load_target(args.target)
    # the same model object when the names agree: one copy in memory, as transformers would share it too
    draft = target if args.draft_model == args.target else load_target(args.draft_model)
    dec = SpeculativeDecoder.from_pretrained(target, draft_model=draft)
    prompts = load_prompts(args.data, args.num_prompts, spread=True)
    n = args.max_new_tokens
    ours = {f"ours_draft_model_k{k}": k for k in args.k}
    methods = ["engine_greedy", "hf_generate", "hf_assisted"] + list(ours)
    tokens, seconds, same = ({m: 0 for m in methods}, {m: 0.0 for m in methods}, {m: 0 for m in methods})
    emitted, rounds = {m: 0 for m in ours}, {m: 0 for m in ours}
    warm = dec.encode(prompts[0]["prompt"])
    dec.generate(warm, 8, speculative=False)
    hf_generate(target, warm, 8)
    hf_generate(target, warm, 8, assistant=draft)
    for i, p in enumerate(prompts):
        ids = dec.encode(p["prompt"])
        base = dec.generate(ids, n, speculative=False)
        runs = {"engine_greedy": (base.token_ids, base.total_s), "hf_generate": hf_generate(target, ids, n),
                "hf_assisted": hf_generate(target, ids, n, assistant=draft)}
        for m, k in ours.items():
            out = dec.generate(ids, n, num_speculative_tokens=k)
            runs[m] = (out.token_ids, out.total_s)
            emitted[m] += sum(out.accept_lengths) + out.rounds
            rounds[m] += out.rounds
        for m, (toks, s) in runs.items():
            tokens[m] += len(toks)
            seconds[m] += s
            same[m] += toks == base.token_ids
        print(f"[{i + 1}/{len(prompts)}] " + ", ".join(f"{m} {len(t) / s:.1f}" for m, (t, s) in runs.items()),
              flush=True)
    tps = {m: tokens[m] / seconds[m] for m in methods}
    result = {"target": args.target, "draft_model": args.draft_model, "num_prompts": len(prompts),
              "max_new_tokens": n, "tokens_per_s": tps,
              "vs_hf_assisted": {m: tps[m] / tps["hf_assisted"] for m in methods},
              "tau": {m: emitted[m] / max(rounds[m], 1) for m in ours},
              "identical_to_engine_greedy": {m: same[m] / len(prompts) for m in methods}}
    print("\n| method | tau | tokens/s | vs transformers assisted | identical to our greedy |\n|---|---|---|---|---|")
    for m in methods:
        tau = result["tau"].get(m)
        print(f"| {m} | {'' if tau is None else f'{tau:.2f}'} | {tps[m]:.1f} | {result['vs_hf_assisted'][m]:.2f}x | "
              f"{result['identical_to_engine_greedy'][m]:.2f} |")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
