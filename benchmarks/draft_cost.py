"""What drafting costs against a target step: ms per drafting round and per head step, as decoding drafts (each
head layer in one C call, `cpu_backend.draft.LAYER_IN_ONE_CALL`; its weights marked by
`cpu_backend.kernels.draft_precision` and read in int8 where the CPU has AMX-INT8, else in bfloat16 on AMX tiles),
against the same C calls made through the modules (no `GreedySteps`), against bfloat16 weights, against the layer
run in parts (torch operations around C products and attention), against float32 weights and against torch's path
(`cpu_backend.draft.kernel_fits` false: the head's stock attention and layers), interleaved.

    .venv/bin/python benchmarks/draft_cost.py --draft runs/demo/head --k 3 --dynamic 2,3,4 4,3,8 [--cold]

A drafting round here is what the decoder does between two verifications: the head reads the one newly committed
(feature, token) pair into its cache and drafts a chain of k tokens or a dynamic tree (top_k, depth,
total_tokens), after --context committed pairs; "as decoding drafts", greedy chains go through
`cpu_backend.draft.GreedySteps` (the same C calls as the modules, without their Python). A head step is one head
pass through the modules over one new row plus its logits over the draft vocabulary. The target step is one target
pass over one new token with the fast path, as greedy decoding runs it. Issue 5 asks for a draft step <= 15 % of a
target step.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time

import torch

from cpu_backend import CPUConfig, draft, kernels, switches
from eagle import load_target
from infer import SpeculativeDecoder
from infer.decoder import DecodeConfig
from infer.proposer import EagleProposer
from speed import pass_ms, real_text  # benchmarks/speed.py: one target pass after `context` tokens of real text


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default="smollm2-135m")
    ap.add_argument("--draft", required=True)
    ap.add_argument("--k", nargs="*", type=int, default=[3], help="chain lengths")
    ap.add_argument("--dynamic", nargs="*", default=["4,3,8"], help="dynamic trees as top_k,depth,total_tokens")
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--data", default="../shared/evaldata/mt_bench.jsonl",
                    help="prompts whose greedy replies make the text the head reads (speed.py's `real_text`)")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--cold", action="store_true",
                    help="read 600 MB before each timed call, as the target pass between two rounds does when "
                         "decoding (the head's weights are then no longer in the caches)")
    args = ap.parse_args()
    target = load_target(args.target)
    dec = SpeculativeDecoder.from_pretrained(target, args.draft)
    dec.use_cpu(CPUConfig())  # the backend and its screens, as decoding has them
    head = dec.head
    text = real_text(dec, args.data, args.context + 1)
    ids = torch.tensor([text])
    with torch.inference_mode():
        feats = target.features(ids[:, :-1], position_ids=torch.arange(args.context)[None])
    settings = {f"chain k = {k}": DecodeConfig(mode="chain", num_speculative_tokens=k) for k in args.k}
    for spec in args.dynamic:
        tk, depth, total = map(int, spec.split(","))
        settings[f"dynamic ({tk}, {depth}, {total})"] = DecodeConfig(mode="dynamic", top_k=tk, depth=depth,
                                                                       total_tokens=total)
    proposer = EagleProposer(head)
    proposer.screen = dec.screens_greedy_tokens  # greedy drafts through the int8 screen, as the decoder sets it
    proposer.propose(feats[:, :-1], ids[:, 1:-1], settings[next(iter(settings))])  # the head reads the context
    committed = args.context - 1  # pairs (feature t, token t + 1) read; the rest of its cache is drafts

    def one_round(cfg: DecodeConfig) -> None:
        proposer.rollback(committed)
        proposer.propose(feats[:, -1:], ids[:, -1:], cfg)

    def head_step() -> None:
        proposer.rollback(committed)
        with torch.inference_mode():
            pos = torch.tensor([[committed]])
            head.logits(head(feats[:, -1:], ids[:, -1:], pos, cache=proposer.cache)[0])

    stock_fits, defaults = draft.kernel_fits, switches.current()
    # (C paths, each head layer in one C call, the head's weights in low precision (`kernels.draft_precision`),
    # in int8 rather than bfloat16, greedy chains through GreedySteps where they fit)
    paths = {"as decoding drafts": (stock_fits, True, True, True, True),
             "through the modules": (stock_fits, True, True, True, False),
             "bfloat16 weights": (stock_fits, True, True, False, True),
             "layer in parts, attention in C": (stock_fits, False, True, True, True),
             "float32 weights": (stock_fits, True, False, True, True),
             "torch": (lambda x, head_dim: False, False, True, True, True)}
    jobs = {name: (lambda cfg=cfg: one_round(cfg)) for name, cfg in settings.items()}
    jobs["one head step"] = head_step
    times: dict[tuple[str, str], list[float]] = {(p, j): [] for p in paths for j in jobs}
    flush = torch.ones(150_000_000) if args.cold else None
    target_ms: list[float] = []
    for rnd in range(args.rounds):
        for path in (list(paths) if rnd % 2 == 0 else list(paths)[::-1]):
            draft.kernel_fits, draft.LAYER_IN_ONE_CALL, low, int8, steps = paths[path]
            switches.use(dataclasses.replace(defaults, low_precision_drafts=low, int8_drafts=int8))
            proposer._steps = None if steps else False  # greedy chains' steps made again for this path, or none
            for name, fn in jobs.items():
                fn()  # warm-up
                for _ in range(args.repeats):
                    if flush is not None:
                        flush.sum()
                    t0 = time.perf_counter()
                    fn()
                    times[(path, name)].append((time.perf_counter() - t0) * 1e3)
        draft.kernel_fits, draft.LAYER_IN_ONE_CALL = stock_fits, True
        switches.use(defaults)
        target_ms.append(pass_ms(dec, text, args.context, [1], args.repeats, fast=True)[1])
    step = statistics.median(target_ms)
    print(f"threads {torch.get_num_threads()}, context {args.context}; median ms over {args.rounds} x {args.repeats}"
          + ("; caches flushed before each call" if args.cold else "")
          + f"; head weights on AMX tiles: {kernels.amx_on()}, in int8: {bool(kernels.library().screen_tiles())}")
    print("| drafting | " + " | ".join(paths) + " |")
    print("|---" * (len(paths) + 1) + "|")
    for name in jobs:
        print(f"| {name} | " + " | ".join(f"{statistics.median(times[(p, name)]):.2f}" for p in paths) + " |")
    c_step = statistics.median(times[("as decoding drafts", "one head step")])
    print(f"target step (one token, fast path): {step:.1f} ms; one head step / target step: {c_step / step:.3f}"
          + "".join(f"; {name} round / target step: {statistics.median(times[('as decoding drafts', name)]) / step:.3f}"
                    for name in settings if name.startswith("chain")))


if __name__ == "__main__":
    main()
