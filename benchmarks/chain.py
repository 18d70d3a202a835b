"""Chain and tree speculative decoding vs plain greedy vs transformers' generate and prompt lookup, all in one run
on the same prompts.

    .venv/bin/python benchmarks/chain.py --draft runs/demo/head --data ../shared/evaldata/mt_bench.jsonl \
        --num-prompts 20 --max-new-tokens 128 --k 2 3 4 5 6 --dynamic 4,4,8 2,5,8 --static configs/trees/small.json

`--dynamic TOP_K,DEPTH,TOTAL_TOKENS` adds EAGLE-2 dynamic trees, `--static FILE` a static tree of choice paths,
`--grid-top-k 2 4 8 --grid-depth 3 5 7 --grid-total 4 8 16 32` every dynamic tree of that grid (a sweep; add
`--no-baselines` to skip transformers' two methods, our greedy stays as the reference). `--spread` takes the
prompts evenly spaced over the file rather than its first ones (MT-bench's first 20 are writing and roleplay only).
`--plus-lookup 4` adds, for every method, a twin whose tree also holds our prompt lookup branch of 4 tokens
(`prompt_lookup_num_tokens`), and our prompt lookup alone; `--after-drafts` then adds, for each head method with
a lookup branch, a twin that also continues each leaf of the head's tree by lookup (`prompt_lookup_after_drafts`).

For every prompt, each method runs back to back (so machine noise hits them alike). Prints a Markdown table and,
as its last line, a JSON object with every number.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

import cpu_backend
from eagle import load_target
from eagle.attention import use_gqa_sdpa
from infer import SpeculativeDecoder
from infer.evaluate import load_prompts


def hf_generate(target, ids: list[int], n: int, lookup: int = 0, assistant=None) -> tuple[list[int], float]:
    """transformers' greedy `generate`, with its prompt lookup (`lookup` tokens) or assisted generation (`assistant`,
    a TargetModel) if asked."""
    for m in (target, assistant or target):
        cpu_backend.disable(m.model)  # transformers as users run it; our decoder enables the backend again
        use_gqa_sdpa(m.model, False)  # and sdpa for the gqa_sdpa that `disable` gives back
    x = torch.tensor([ids])
    kw = {"prompt_lookup_num_tokens": lookup} if lookup else {}
    if assistant is not None:
        kw["assistant_model"] = assistant.model
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
    ap.add_argument("--spread", action="store_true", help="prompts evenly spaced over the file, not its first ones")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--k", type=int, nargs="+", default=[2, 3, 4, 5, 6])
    ap.add_argument("--dynamic", nargs="*", default=[], metavar="TOP_K,DEPTH,TOTAL",
                    help="dynamic trees to add, e.g. 4,4,8")
    ap.add_argument("--static", nargs="*", default=[], metavar="FILE", help="static trees (JSON choice lists)")
    ap.add_argument("--grid-top-k", type=int, nargs="*", default=[])
    ap.add_argument("--grid-depth", type=int, nargs="*", default=[])
    ap.add_argument("--grid-total", type=int, nargs="*", default=[])
    ap.add_argument("--lookup", type=int, default=10, help="prompt_lookup_num_tokens for transformers")
    ap.add_argument("--plus-lookup", type=int, nargs="*", default=[], metavar="M",
                    help="for every method above, a twin with our prompt lookup branch of M tokens merged into "
                         "its tree; and our prompt lookup of M tokens alone")
    ap.add_argument("--lookup-ngram", default="2,4", metavar="MIN,MAX",
                    help="suffix lengths our prompt lookup matches (prompt_lookup_min, prompt_lookup_max)")
    ap.add_argument("--after-drafts", action="store_true",
                    help="for every head method with a lookup branch, a twin that also continues each leaf of the "
                         "head's tree with a lookup (prompt_lookup_after_drafts)")
    ap.add_argument("--baselines", action=argparse.BooleanOptionalAction, default=True,
                    help="also run transformers' generate and prompt lookup")
    args = ap.parse_args()
    args.dynamic += [f"{k},{d},{t}" for k in args.grid_top_k for d in args.grid_depth for t in args.grid_total]
    spec = {f"chain_k{k}": dict(mode="chain", num_speculative_tokens=k) for k in args.k}
    for d in args.dynamic:
        top_k, depth, total = (int(x) for x in d.split(","))
        spec[f"dynamic_{top_k}_{depth}_{total}"] = dict(mode="dynamic", top_k=top_k, depth=depth, total_tokens=total)
    for f in args.static:
        spec[f"static_{f.rsplit('/', 1)[-1].removesuffix('.json')}"] = dict(mode="static", tree=f)
    lo, hi = (int(x) for x in args.lookup_ngram.split(","))
    alone = set()  # methods drafted by prompt lookup alone, without the head
    for m in args.plus_lookup:
        look = dict(prompt_lookup_num_tokens=m, prompt_lookup_min=lo, prompt_lookup_max=hi)
        spec.update({f"{name}+lookup{m}": {**kw, **look} for name, kw in list(spec.items()) if "lookup" not in name})
        spec[f"lookup{m}_alone"] = look
        alone.add(f"lookup{m}_alone")
    if args.after_drafts:
        spec.update({f"{name}+after": {**kw, "prompt_lookup_after_drafts": True} for name, kw in list(spec.items())
                     if "+lookup" in name})

    target = load_target(args.target)
    dec = SpeculativeDecoder.from_pretrained(target, args.draft)
    prompts = load_prompts(args.data, args.num_prompts, args.spread)
    n = args.max_new_tokens
    methods = ["engine_greedy"] + (["hf_generate", "hf_prompt_lookup"] if args.baselines else []) + list(spec)
    tokens = {m: 0 for m in methods}
    seconds = {m: 0.0 for m in methods}
    cats = sorted({p["category"] for p in prompts})
    cat_rounds = {m: {c: [0, 0] for c in cats} for m in spec}  # emitted, verify passes
    draft_verify = {m: [0.0, 0.0] for m in spec}
    same = {m: 0 for m in methods}
    warm = dec.encode(prompts[0]["prompt"])
    dec.generate(warm, 8, speculative=False)
    lookup_dec = SpeculativeDecoder(target, None)  # prompt lookup alone, on our engine
    for m, kw in spec.items():
        (lookup_dec if m in alone else dec).generate(warm, 8, **kw)
    if args.baselines:
        hf_generate(target, warm, 8)
    for i, p in enumerate(prompts):
        ids = dec.encode(p["prompt"])
        base = dec.generate(ids, n, speculative=False)
        ref = base.token_ids
        runs = {"engine_greedy": (ref, base.total_s)}
        if args.baselines:
            runs["hf_generate"] = hf_generate(target, ids, n)
            runs["hf_prompt_lookup"] = hf_generate(target, ids, n, args.lookup)
        for m, kw in spec.items():
            out = (lookup_dec if m in alone else dec).generate(ids, n, **kw)
            runs[m] = (out.token_ids, out.total_s)
            cat_rounds[m][p["category"]][0] += sum(out.accept_lengths) + out.rounds
            cat_rounds[m][p["category"]][1] += out.rounds
            draft_verify[m][0] += out.draft_s
            draft_verify[m][1] += out.verify_s
        for m, (toks, s) in runs.items():
            tokens[m] += len(toks)
            seconds[m] += s
            same[m] += toks == ref
        print(f"[{i + 1}/{len(prompts)}] " + ", ".join(f"{m} {len(t) / s:.1f}" for m, (t, s) in runs.items()),
              flush=True)
    tps = {m: tokens[m] / seconds[m] for m in methods}
    rounds = {m: [sum(e for e, _ in cr.values()), sum(r for _, r in cr.values())] for m, cr in cat_rounds.items()}
    result = {
        "target": args.target, "draft": args.draft, "data": args.data, "num_prompts": len(prompts),
        "max_new_tokens": n, "threads": torch.get_num_threads(),
        "tokens_per_s": tps,
        "speedup_vs_engine_greedy": {m: tps[m] / tps["engine_greedy"] for m in methods},
        "tau": {m: e / max(r, 1) for m, (e, r) in rounds.items()},
        "tau_by_category": {m: {c: e / max(r, 1) for c, (e, r) in cr.items()} for m, cr in cat_rounds.items()},
        "ms_per_round": {m: {"draft": 1e3 * dv[0] / max(rounds[m][1], 1), "verify": 1e3 * dv[1] / max(rounds[m][1], 1)}
                         for m, dv in draft_verify.items()},
        "settings": spec,
        "identical_to_engine_greedy": {m: same[m] / len(prompts) for m in methods},
    }
    print()
    print("| method | tau | tokens/s | speedup vs our greedy | draft ms / round | verify ms / round | identical |")
    print("|---|---|---|---|---|---|---|")
    for m in methods:
        tau, ms = result["tau"].get(m), result["ms_per_round"].get(m)
        draft, verify = ("", "") if ms is None else (f"{ms['draft']:.1f}", f"{ms['verify']:.1f}")
        print(f"| {m} | {'' if tau is None else f'{tau:.2f}'} | {tps[m]:.1f} | "
              f"{result['speedup_vs_engine_greedy'][m]:.2f}x | {draft} | {verify} | "
              f"{result['identical_to_engine_greedy'][m]:.2f} |")
    if len(cats) > 1:
        counts = {c: sum(p["category"] == c for p in prompts) for c in cats}
        print("\n| tau by category | " + " | ".join(f"{c} ({counts[c]})" for c in cats) + " |")
        print("|---|" + "---|" * len(cats))
        for m, by_cat in result["tau_by_category"].items():
            print(f"| {m} | " + " | ".join(f"{by_cat[c]:.2f}" for c in cats) + " |")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
