"""Whole target passes with this tree's fast path against another git revision's, in one process.

    .venv/bin/python benchmarks/pass_ab.py --against HEAD~1 --rows 1 4 8 16

The Python side of the fast path (`cpu_backend/fastpath.py`: which forwards are patched and how they call the kernels)
is taken from the revision; the C kernels and everything else are this tree's, so the comparison isolates the
patched forwards. With `--kernel` the revision's C kernels (`cpu_backend/kernels.py`) are used for its variant too,
each variant with the layout plan calibrated for its kernels:

    .venv/bin/python benchmarks/pass_ab.py --against HEAD --kernel --rows 1 2 4 8 16 32
 Four variants are timed, interleaved round by round (order reversed every other round), after
a KV cache of --context tokens: the revision's, this tree's without its one-call decoder layers (each layer runs
its patched norms, attention and MLP), this tree's with each layer in one call but not all layers in one call
(`kernels.decoder_stack`), and this tree's.
The table shows ms per pass (features and logits of every row, speed.py's `pass_ms`) for each number of new
tokens.
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import subprocess
import sys
from pathlib import Path

import torch

from cpu_backend import fastpath
from eagle import attention, load_target
from infer import SpeculativeDecoder
from speed import pass_ms, real_text  # benchmarks/speed.py: one target pass after `context` tokens of real text


def module_at(rev: str, path: str):
    """`path` (e.g. cpu_backend/fastpath.py) as it was at git revision `rev`, imported as a module of its own."""
    root = Path(__file__).resolve().parent.parent
    src = subprocess.run(["git", "show", f"{rev}:{path}"], check=True, capture_output=True, text=True,
                         cwd=root).stdout
    name = f"{Path(path).stem}_{rev.replace('~', '_').replace('^', '_')}"
    module = importlib.util.module_from_spec(importlib.util.spec_from_loader(name, loader=None))
    sys.modules[name] = module  # dataclasses look their module up
    exec(compile(src, f"{rev}:{path}", "exec"), module.__dict__)
    return module


def fastlinear_at(rev: str, kernel: bool = False):
    """cpu_backend/fastpath.py as it was at `rev`; with `kernel`, calling the C kernels of that revision too (its
    cpu_backend/kernels.py, built into the kernel cache under its own key)."""
    module = module_at(rev, "cpu_backend/fastpath.py")
    if kernel:
        module.kernels = module_at(rev, "cpu_backend/kernels.py")
    return module


def use_kernels_of(module) -> None:
    """Route gqa_sdpa's attention kernel through the kernels module that fastpath `module` calls."""
    attention.kernels = module.kernels


def unfuse(model: torch.nn.Module, layers: bool) -> None:
    """Drop the one-call stack of all layers (the base model's forward) and, with `layers`, the one-call decoder layer
    forwards too (keeping every other patch: the layers run their patched parts)."""
    for mod in model.modules():
        if "_fast_module" in mod.__dict__ and ("_stack_rows" in mod.__dict__ or layers and hasattr(mod, "self_attn")):
            del mod.forward, mod._fast_module


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default="smollm2-135m")
    ap.add_argument("--against", default="HEAD")
    ap.add_argument("--rows", nargs="+", type=int, default=[1, 4, 8, 12, 16])
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--data", default="../shared/evaldata/mt_bench.jsonl",
                    help="prompts whose greedy replies make the passes' text (speed.py's `real_text`)")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--passes", type=int, default=3, help="timed passes per variant, row count and round")
    ap.add_argument("--kernel", action="store_true", help="the revision's C kernels too (else this tree's for all)")
    args = ap.parse_args()
    target = load_target(args.target)
    dec = SpeculativeDecoder(target, None)
    text = real_text(dec, args.data, args.context + max(args.rows))
    dec.use_fast_path(True)  # gqa attention on, and the plan decoding uses (calibrated once per machine)
    plan = fastpath.load_or_calibrate(target.model, run=dec._calibration_pass)
    old = fastlinear_at(args.against, kernel=args.kernel)
    plans = {fastpath: plan, old: plan}
    if args.kernel:  # the revision's kernels get the plan calibrated for them
        fastpath.disable_fast_linear(target.model)
        use_kernels_of(old)
        plans[old] = old.load_or_calibrate(target.model, run=dec._calibration_pass)
    variants = {args.against: (old, None), "this tree, layers not in one call": (fastpath, "layers"),
                "this tree, each layer in one call": (fastpath, "stack"), "this tree": (fastpath, None)}
    times: dict[tuple[str, int], list[float]] = {(v, r): [] for v in variants for r in args.rows}
    for rnd in range(args.rounds):
        order = list(variants.items())
        for name, (module, unfused) in order if rnd % 2 == 0 else order[::-1]:
            fastpath.disable_fast_linear(target.model)
            use_kernels_of(module)
            module.enable_fast_linear(target.model, plans[module])
            if unfused:
                unfuse(target.model, layers=unfused == "layers")
            # pass_ms keeps these patches: use_fast_path(True) patches only a model that has none
            for rows, ms in pass_ms(dec, text, args.context, args.rows, args.passes, fast=True).items():
                times[(name, rows)].append(ms)
    print(f"threads {torch.get_num_threads()}, context {args.context}; median over {args.rounds} rounds of "
          f"each round's median ms per pass ({args.passes} passes)")
    print("| variant | " + " | ".join(f"M = {r}" for r in args.rows) + " |")
    print("|---|" + "---|" * len(args.rows))
    for name in variants:
        print(f"| {name} | " + " | ".join(f"{statistics.median(times[(name, r)]):.1f}" for r in args.rows) + " |")


if __name__ == "__main__":
    main()
