"""Regeneration speed: the stock layers with `sdpa` against the CPU backend (`cpu_backend.enable`: the packed kernel
for every row count, the C attention, else `gqa_sdpa`), interleaved, on the same ShareGPT rows, with the demo's
settings by default.

    .venv/bin/python benchmarks/regen_speed.py --skip-rows 3000 --rows 160 --rounds 2

Prints tokens/s of each run and whether the two paths wrote the same replies.
"""

from __future__ import annotations

import argparse
import importlib
import types

import cpu_backend
from eagle import load_target
from data_prep.sources import load_conversations

regenerate = importlib.import_module("data_prep.regenerate")  # the module (the package exports a function by its name)
# what regeneration sees of the backend in the stock runs: it does not apply, so nothing is patched
NO_BACKEND = types.SimpleNamespace(applies=lambda model: False)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default="smollm2-135m")
    ap.add_argument("--data", default="sharegpt")
    ap.add_argument("--skip-rows", type=int, default=3000)
    ap.add_argument("--rows", type=int, default=160)
    ap.add_argument("--batch-size", type=int, default=128)
    ap.add_argument("--max-new-tokens", type=int, default=192)
    ap.add_argument("--max-prompt-tokens", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    target = load_target(args.target)
    convs, _ = load_conversations(args.data, max_rows=args.rows, skip_rows=args.skip_rows)
    gqa = regenerate.use_gqa_sdpa
    tps: dict[str, list[float]] = {"stock": [], "fast": []}
    replies = {}
    for rnd in range(args.rounds):
        for name in ("stock", "fast") if rnd % 2 == 0 else ("fast", "stock"):
            # stock: regeneration finds no backend to enable (so patches nothing) and keeps sdpa
            regenerate.use_gqa_sdpa = (lambda model, on: False) if name == "stock" else gqa
            regenerate.cpu_backend = NO_BACKEND if name == "stock" else cpu_backend
            r = regenerate.regenerate_with_stats(target, convs, args.max_new_tokens, args.batch_size,
                                                 args.max_prompt_tokens)
            tps[name].append(r.new_tokens / r.seconds)
            replies[name] = [c[-1]["content"] if c and c[-1]["role"] == "assistant" else None
                             for c in r.conversations]
            print(f"{name}: {r.new_tokens} tokens in {r.seconds:.1f} s, {tps[name][-1]:.1f} tokens/s", flush=True)
    same = sum(a == b for a, b in zip(replies["stock"], replies["fast"]))
    print({name: [round(x, 1) for x in v] for name, v in tps.items()},
          f"identical replies {same}/{len(replies['stock'])}")


if __name__ == "__main__":
    main()
