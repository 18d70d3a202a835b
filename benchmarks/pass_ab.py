"""Whole target passes with this tree's fast path against another git revision's, in one process.

    .venv/bin/python benchmarks/pass_ab.py --against HEAD~1 --rows 1 4 8 16

The Python side of the fast path (its cpu_backend/ package, imported as a package of its own, where it has
`parts.py`; before, its `cpu_backend/fastpath.py` or `eagle/fastlinear.py`: which modules the backend replaces and how
they call the kernels) is taken from the revision; the C kernels, the C attention and everything else are this
tree's, so the comparison isolates the backend's modules. A revision whose fast path reads the kernels' old switch
globals (`kernels.AMX`, ...; before the switches became one object) needs `--kernel`. With
`--kernel` the revision's C kernels (`cpu_backend/kernels.py` and its csrc/, or `eagle/cpukernel.py` before) are
used for its variant too, each variant with the layout plan calibrated for its kernels:

    .venv/bin/python benchmarks/pass_ab.py --against HEAD --kernel --rows 1 2 4 8 16 32

Four variants are timed, interleaved round by round (order reversed every other round), after
a KV cache of --context tokens: the revision's, this tree's without its one-call decoder layers (each layer runs
its patched norms, attention and MLP), this tree's with each layer in one call but not all layers in one call
(`cpu_backend.kernels.decoder_stack`), and this tree's.
The table shows ms per pass (features and the greedy token of every row from the whole lm_head, speed.py's
`pass_ms` without the screen) for each number of new tokens.
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import re
import shutil
import statistics
import sys
from pathlib import Path

import torch

import cpu_backend
from cpu_backend import attention as cpu_attention
from cpu_backend import fastpath, fused
from cpu_backend import kernels as cpu_kernels
from eagle import load_target
from infer import SpeculativeDecoder
from kernel import files_at  # benchmarks/kernel.py: a revision's files in a temporary directory
from speed import pass_ms, real_text  # benchmarks/speed.py: one target pass after `context` tokens of real text

# A revision from before cpu_backend/ imports what cpu_backend/ holds now under the old names; its eagle/ files get
# this tree's modules instead (the C attention, its name and row limit included, was in eagle.attention then)
OLD_IMPORTS = {"from eagle import cpukernel": "from cpu_backend import kernels as cpukernel",
               "from eagle import gguf_codes": "from cpu_backend import gguf_codes",
               "from eagle.attention import": "from cpu_backend.attention import"}


def module_at(rev: str, path: str):
    """`path` (e.g. cpu_backend/fastpath.py) as it was at git revision `rev`, imported as a module of its own from a
    copy of the revision's eagle/ and cpu_backend/ (so that its `__file__` finds its C beside it, as there)."""
    file = tree_at(rev) / path
    src = file.read_text()
    if path.startswith("eagle/"):
        for old, new in OLD_IMPORTS.items():
            src = re.sub(rf"^{re.escape(old)}\b", new, src, flags=re.M)
    name = file.stem + "_at_" + re.sub(r"\W", "_", rev)
    module = importlib.util.module_from_spec(importlib.util.spec_from_loader(name, loader=None))
    module.__file__ = str(file)
    sys.modules[name] = module  # dataclasses look their module up
    exec(compile(src, f"{rev}:{path}", "exec"), module.__dict__)
    return module


@functools.cache
def tree_at(rev: str) -> Path:
    """The revision's eagle/ and cpu_backend/ (those it has) in a temporary directory."""
    return files_at(rev, "eagle", "cpu_backend")


def fastpath_at(rev: str, kernel: bool = False):
    """The fast path's module as it was at `rev` (cpu_backend/fastpath.py, or eagle/fastlinear.py before it); with
    `kernel`, calling the C kernels of that revision too (its cpu_backend/kernels.py, or eagle/cpukernel.py, built
    into the kernel cache under its own key)."""
    split = (tree_at(rev) / "cpu_backend" / "parts.py").exists()  # the fast path in several modules of the package
    moved = (tree_at(rev) / "cpu_backend" / "fastpath.py").exists()
    path = "cpu_backend/fastpath.py" if moved else "eagle/fastlinear.py"
    files = sorted((tree_at(rev) / "cpu_backend").glob("*.py")) if split else [tree_at(rev) / path]
    if not kernel and any(re.search(r"\b(kernels|cpukernel)\.(Q4_1|AMX|VNNI)\b", f.read_text()) for f in files):
        # this tree's kernels have no such globals (the switches are one object now): its checks would fail quietly
        raise SystemExit(f"{rev}: its fast path reads the kernels' switch globals; compare it with --kernel")
    if split:
        return package_at(rev, kernel).fastpath
    module = module_at(rev, path)
    if kernel:
        kernels = module_at(rev, "cpu_backend/kernels.py" if moved else "eagle/cpukernel.py")
        setattr(module, "kernels" if moved else "cpukernel", kernels)
    return module


def package_at(rev: str, kernel: bool):
    """The revision's cpu_backend/ imported as a package of its own, `cpu_backend_at_<rev>`, whose modules import
    each other rather than this tree's (`eagle` stays this tree's); without `kernel`, those that call the kernels
    module call this tree's."""
    name = "cpu_backend_at_" + re.sub(r"\W", "_", rev)
    if name not in sys.modules:
        folder = tree_at(rev)
        shutil.copytree(folder / "cpu_backend", folder / name)
        for file in (folder / name).glob("*.py"):
            file.write_text(re.sub(r"^(\s*)(from|import) cpu_backend\b", rf"\1\2 {name}", file.read_text(), flags=re.M))
        sys.path.insert(0, str(folder))
        sys.modules[f"{name}.attention"] = cpu_attention  # this tree's C attention, as for older revisions
        importlib.import_module(f"{name}.fastpath")
    package = sys.modules[name]
    if not kernel:
        own = sys.modules[f"{name}.kernels"]
        for key, module in list(sys.modules.items()):
            if key.startswith(f"{name}.") and getattr(module, "kernels", None) is own:
                module.kernels = cpu_kernels
    return package


def kernels_of(module):
    """The kernels module that fast path `module` calls (named `cpukernel` before cpu_backend/)."""
    return module.kernels if hasattr(module, "kernels") else module.cpukernel


def use_kernels_of(module, model: torch.nn.Module, every: tuple) -> None:
    """Every fast path's modules off `model` (this tree's backend classes, a revision's patched forwards), and the C
    attention (this tree's `cpu_backend.attention`) on, calling the kernels module that fast path `module` calls.
    (This tree's fast path switches that attention on itself; one from before cpu_backend/ left it to the
    decoder.)"""
    for other in every:  # (a revision with cpu_backend/ split in modules has backend classes of its own)
        other.disable_fast_linear(model)
    cpu_attention.kernels = kernels_of(module)
    cpu_attention.use(model, True)


def unfuse(model: torch.nn.Module, layers: bool) -> None:
    """Give the one-call stack of all layers (the base model) its stock class again and, with `layers`, the one-call
    decoder layers too (keeping every other backend module: the layers run their backend parts)."""
    for mod in model.modules():
        if isinstance(mod, fused.FusedStack) or layers and isinstance(mod, fused.FusedLayer):
            mod.to_stock()


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
    dec.use_fast_path(True)  # the backend on as decoding runs it, and the plan it uses (calibrated once per machine)
    plan = fastpath.load_or_calibrate(target.model, run=dec._calibration_pass)
    # from here on this script puts each variant's modules on; the decoder must not enable this tree's over them
    cpu_backend.enabled = lambda model: True
    old = fastpath_at(args.against, kernel=args.kernel)
    plans = {fastpath: plan, old: plan}
    if args.kernel:  # the revision's kernels get the plan calibrated for them
        use_kernels_of(old, target.model, (old, fastpath))
        plans[old] = old.load_or_calibrate(target.model, run=dec._calibration_pass)
    variants = {args.against: (old, None), "this tree, layers not in one call": (fastpath, "layers"),
                "this tree, each layer in one call": (fastpath, "stack"), "this tree": (fastpath, None)}
    times: dict[tuple[str, int], list[float]] = {(v, r): [] for v in variants for r in args.rows}
    for rnd in range(args.rounds):
        order = list(variants.items())
        for name, (module, unfused) in order if rnd % 2 == 0 else order[::-1]:
            use_kernels_of(module, target.model, (old, fastpath))
            module.enable_fast_linear(target.model, plans[module])
            if unfused:
                unfuse(target.model, layers=unfused == "layers")
            # greedy tokens from the whole lm_head in every variant: this tree's screen takes only its own PackedLinear
            for rows, ms in pass_ms(dec, text, args.context, args.rows, args.passes, fast=True, screen=False).items():
                times[(name, rows)].append(ms)
    print(f"threads {torch.get_num_threads()}, context {args.context}; median over {args.rounds} rounds of "
          f"each round's median ms per pass ({args.passes} passes)")
    print("| variant | " + " | ".join(f"M = {r}" for r in args.rows) + " |")
    print("|---|" + "---|" * len(args.rows))
    for name in variants:
        print(f"| {name} | " + " | ".join(f"{statistics.median(times[(name, r)]):.1f}" for r in args.rows) + " |")


if __name__ == "__main__":
    main()
