"""Where one target pass's time goes, by module, for M new tokens after a KV cache of --context tokens.

    .venv/bin/python benchmarks/pass_profile.py --rows 1 4 8 16

Forward hooks time every decoder layer's parts (the attention module as a whole: its four projections, rotary
embedding, cache update and the attention itself, since the fused forward of cpu_backend.fastpath calls three of the
projections directly; the MLP; the two norms), the final norm, the embedding and the lm_head; "other" is the pass
minus all of them (the model's own glue: masks, position embeddings, residual sums, Python).
Fast path on, with the layouts decoding uses (`SpeculativeDecoder.use_fast_path`). Passes with different M are
interleaved; the table shows the median ms per pass over --repeats rounds.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections import defaultdict

import torch

from eagle import load_target
from infer import SpeculativeDecoder
from infer.cache import TargetCache


def part_of(name: str) -> str | None:
    leaf = name.rsplit(".", 1)[-1]
    if leaf == "self_attn":  # the whole module: its projections are not always called as modules (fastpath)
        return "attention (projections, rotary, cache, attend)"
    if leaf == "mlp":
        return "mlp"
    if leaf.endswith("layernorm") or name.endswith("model.norm"):
        return "norms"
    if leaf == "embed_tokens":
        return "embedding"
    if leaf == "rotary_emb":
        return "rotary cos/sin"
    if leaf == "lm_head":
        return "lm_head"
    return None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default="smollm2-135m")
    ap.add_argument("--rows", nargs="+", type=int, default=[1, 4, 8, 16])
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=9)
    args = ap.parse_args()
    target = load_target(args.target)
    SpeculativeDecoder(target, None).use_fast_path(True)  # the layouts decoding uses (calibrated once per machine)

    spent: dict[str, float] = defaultdict(float)
    started: dict[str, float] = {}
    for name, mod in target.model.named_modules():
        part = part_of(name)
        if part is None:
            continue
        mod.register_forward_pre_hook(lambda m, a, name=name: started.__setitem__(name, time.perf_counter()))

        def done(m, a, out, name=name, part=part):
            spent[part] += time.perf_counter() - started[name]
        mod.register_forward_hook(done)

    cache = TargetCache()
    g = torch.Generator().manual_seed(0)
    ctx = torch.randint(100, 20000, (1, args.context), generator=g)
    with torch.inference_mode():
        target.features(ctx, position_ids=torch.arange(args.context)[None], cache=cache.hf)
        runs: dict[int, list[dict[str, float]]] = {r: [] for r in args.rows}
        for rep in range(args.repeats + 1):
            for rows in args.rows:
                ids = torch.randint(100, 20000, (1, rows), generator=g)
                pos = torch.arange(args.context, args.context + rows)[None]
                spent.clear()
                t0 = time.perf_counter()
                feats = target.features(ids, position_ids=pos, cache=cache.hf)
                target.logits(feats[0]).argmax(-1)
                total = time.perf_counter() - t0
                cache.crop(args.context)
                if rep:
                    rec = {k: v * 1e3 for k, v in spent.items()}
                    rec["other"] = total * 1e3 - sum(spent.values()) * 1e3
                    rec["pass"] = total * 1e3
                    runs[rows].append(rec)
    parts = list(runs[args.rows[0]][0])
    print(f"threads {torch.get_num_threads()}, context {args.context}; median ms per pass of {args.repeats}")
    print("| part | " + " | ".join(f"M = {r}" for r in args.rows) + " |")
    print("|---|" + "---|" * len(args.rows))
    for part in parts:
        print(f"| {part} | " + " | ".join(f"{statistics.median(x[part] for x in runs[r]):.1f}" for r in args.rows)
              + " |")


if __name__ == "__main__":
    main()
