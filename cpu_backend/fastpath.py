"""Faster `nn.Linear` forwards for decoding on CPU: the matmul layout is chosen per weight shape and row count,
by measurement on the machine that runs it.

At batch 1 every decoder step multiplies each weight by a handful of rows, so a step is bound by reading the
weights. The stock `F.linear(x, W)` is a poor reader for 1-16 rows on this machine (torch 2.13, MKL, 2 threads:
SmolLM2's 30 layers take ~44-54 ms for one row and ~60 ms for eight). Three layouts are measured:
`linear` (the stock product), `wxt` (`(W @ x.T).T`, one row padded to two: ~25 ms for 2-4 rows) and `kernel`
(`cpu_backend.kernels`, a small C kernel that streams each weight row once: ~31-36 ms for 1-4 rows
where `F.linear` took 52 ms for one). Which layout wins depends on the shape, the row count and the machine,
so `calibrate` times them all and keeps the fastest: over whole forward passes when it is given a function that
runs one (the decoder does), else over all weights of each shape in a cold sweep.

    enable_fast_linear(target.model)    # every nn.Linear a PackedLinear (the same object), and the rest below
    ...
    disable_fast_linear(target.model)   # the stock classes again

This module measures the plan (`calibrate`) and enables; the pieces live beside it: `plan` (the layouts, `Plan` and
its cache file), `parts` (PackedLinear, KernelNorm, KernelMLP) and `fused` (KernelAttention, FusedLayer,
FusedStack), all `modules.BackendModule`s (a subclass made per stock class, the module's plan in `cpu_plan`).
With the kernel available, `enable_fast_linear` also gives RMS norms and gated (SiLU) MLPs theirs
(KernelNorm, KernelMLP), each only after checking on a random input that the kernel computes what the module's
stock forward computes (so a norm that scales by `1 + weight`, or another activation, is found so or keeps its
stock class); an MLP uses the gated kernel at the row counts where the plan chose the kernel for its gate
projection. Llama-style attention modules (q / k / v / o projections and nothing else, or with q / k norms) become
KernelAttention: the same steps with far fewer torch operations (the rotary embedding in one C call, the products
called directly): on this machine a step's Python and torch overhead around the C calls was ~10 ms of ~60
(BENCHMARKS.md); one sequence of up to 64 rows with a preallocated cache in one C call (`kernels.attention_block`).
A decoder layer whose norms, attention and MLP are all backend modules becomes FusedLayer, in one C call
(`kernels.decoder_layer`, bit for bit what its parts compute) for such passes, after a check with random rows and a
cache that it computes what the layer's own forward does. A base model (Llama-style: embedding, such layers, norm,
rotary embedding, full attention) then becomes FusedStack, all its layers in one C call (`kernels.decoder_stack`),
after a check that this gives its own forward's numbers bit for bit: the Python around 30 layer calls was ~4-5 ms
of a ~32 ms SmolLM2 pass (BENCHMARKS.md).

The plan is cached per machine, thread count, torch version, set of shapes, available layouts and kernel path
(`kernels.path_key`: the build and the `EAGLE_NO_*` switches) under `$EAGLE_CACHE/fastpath/`;
`EAGLE_RECALIBRATE=1` measures it again. A plan changes speed only: every layout gives the target's tokens.
With gradients enabled (training a head) a PackedLinear's products, forward and backward, run through the
packed kernel too (`train_linear`), or through `F.linear` where `plan_training` measured that faster; norms,
attention and MLPs keep their stock forwards there. On other devices the stock forward runs. Above `MAX_ROWS`
rows (a prefill, a regeneration batch) the layout measured for `MAX_ROWS` applies: the packed kernel multiplies
256-1024 rows at 2.3-2.7x `F.linear`'s speed here (BENCHMARKS.md). Results agree with the stock forward to float32
rounding (the summation order differs).
"""

from __future__ import annotations

import statistics
import time
from collections import defaultdict
from collections.abc import Callable

import torch
from torch import nn

from cpu_backend import attention, fused, kernels, parts
from cpu_backend.modules import BackendModule
from cpu_backend.parts import LinearPlan, PackedLinear
from cpu_backend.plan import (BUCKETS, KERNEL_MARGIN, MAX_ROWS, Plan, available_layouts, cache_path, cached_json,
                              fitting, linear, linears, shape_key)


def calibrate(model: nn.Module, repeats: int = 5, run: Callable[[int], float] | None = None) -> Plan:
    """Time the layouts at every bucket and keep the fastest (median of repeats, layouts interleaved; the kernel
    unless another is more than KERNEL_MARGIN faster).

    With `run` (a function that does one real forward pass over `rows` new tokens and returns its seconds)
    whole passes are timed with
    one layout for every weight: this is the measurement that matters, because a pass interleaves the matmuls
    with many small ops and the thread pool behaves differently than in a tight loop of matmuls. Without it,
    each weight shape is timed alone in a sweep over all weights of that shape (cold, as in a step)."""
    groups: dict[str, list[nn.Linear]] = defaultdict(list)
    for mod in linears(model):
        groups[shape_key(mod.weight)].append(mod)
    plan = Plan(layouts={k: {} for k in groups}, timings={k: {} for k in groups})
    with torch.inference_mode():
        for rows in BUCKETS:
            if run is not None:
                times = _time_passes(model, groups, rows, repeats, run)
                per_shape = {key: times for key in groups}
            else:
                per_shape = {key: _time_sweep(mods, rows, repeats) for key, mods in groups.items()}
            for key, times in per_shape.items():
                plan.timings[key][rows] = times
                plan.layouts[key][rows] = _choose(times)
    if run is not None:
        # the stock classes back once at the end, not after every row count: that drops the packed weights, and
        # packing them all again (finding their GGUF codes) after each was ~20 % of a fresh machine's calibration
        _unpatch(model)
    return plan


def _choose(times: dict[str, float]) -> str:
    """The fastest layout, or the kernel where none beats it by more than KERNEL_MARGIN."""
    best = min(times, key=times.get)
    return "kernel" if "kernel" in times and times["kernel"] <= KERNEL_MARGIN * times[best] else best


def _time_passes(model, groups, rows: int, repeats: int, run) -> dict[str, float]:
    """Median ms of whole passes with every weight in one layout, layouts interleaved; the first round warms up."""
    samples = {layout: [] for layout in available_layouts()}
    for r in range(repeats + 1):
        for layout in samples:
            enable_fast_linear(model, Plan(layouts={k: {b: layout for b in BUCKETS} for k in groups}))
            seconds = run(rows)
            if r:
                samples[layout].append(seconds * 1e3)
    return {layout: round(statistics.median(v), 3) for layout, v in samples.items()}


def _time_sweep(mods: list[nn.Linear], rows: int, repeats: int) -> dict[str, float]:
    """Median ms of one sweep over distinct weights of a shape (read from memory, as a step does) per layout."""
    w0 = mods[0].weight
    gen = torch.Generator(device="cpu").manual_seed(rows)  # leaves the global RNG alone
    x = torch.randn(rows, w0.shape[1], generator=gen, dtype=w0.dtype).to(w0.device)
    times = {}
    for layout in available_layouts():
        samples = []
        for r in range(repeats + 1):
            t0 = time.perf_counter()
            for mod in mods:
                linear(x, mod.weight, mod.bias, layout)
            if r:
                samples.append((time.perf_counter() - t0) * 1e3)
        times[layout] = round(statistics.median(samples), 4)
    return times


def load_or_calibrate(model: nn.Module, run: Callable[[int], float] | None = None) -> Plan:
    """The cached plan for this machine and model shapes, or a fresh calibration (seconds) saved for next time."""
    return Plan.from_json(cached_json(cache_path(model, "sweep" if run is None else "passes"),
                                       lambda: calibrate(model, run=run).to_json()))



def _patch_modules(model: nn.Module) -> None:
    """Give RMS norms, gated MLPs, Llama-style attention modules, decoder layers and base models the backend's
    classes where the kernels compute what their stock forward does (modules that have one already keep it), each
    after the parts it is made of (the linear layers came first)."""
    if kernels.available():
        parts.patch(model)
        fused.patch(model)


def enable_fast_linear(model: nn.Module, plan: Plan | None = None, run: Callable[[int], float] | None = None) -> Plan:
    """Give every `nn.Linear` in `model` the backend's PackedLinear class with the measured layouts (`plan`, else
    the cached or a fresh calibration, by whole passes when `run` is given; see `calibrate`), then the norms,
    MLPs, attention modules, layers and base models theirs (`_patch_modules`). Enabling again replaces the linear
    layers' plans; whoever calls `disable_fast_linear` gets the stock classes back."""
    if hasattr(getattr(model, "config", None), "_attn_implementation"):
        attention.use(model, True)  # before the layers are planned: their one-call paths need this attention
    plan = plan or load_or_calibrate(model, run)
    by_shape = {}  # one list per weight shape (read only): a calibration enables a model hundreds of times
    for mod in linears(model):
        # the layout for every row count, looked up once here instead of on every call
        key = (shape_key(mod.weight), kernels.supports(mod.weight))  # what the plan and `fitting` read
        if key not in by_shape:
            by_shape[key] = [fitting(plan.layout(mod.weight, max(rows, 1)), mod.weight)
                             for rows in range(MAX_ROWS + 1)]
        if isinstance(mod, PackedLinear):
            mod.cpu_plan.by_rows = by_shape[key]
        else:
            PackedLinear.from_stock(mod, LinearPlan(by_shape[key]))
    _patch_modules(model)
    return plan


def disable_fast_linear(model: nn.Module) -> None:
    """The stock class of every backend module in `model` (shared layers included), and the attention it had."""
    if hasattr(getattr(model, "config", None), "_attn_implementation"):
        attention.use(model, False)
    _unpatch(model)


def _unpatch(model: nn.Module) -> None:
    """`disable_fast_linear` but for the attention (calibration enables and disables the layers between passes),
    and the memory of the kernels' copies of the weights (packed layouts, a norm's 1 + weight)."""
    for mod in list(model.modules()):
        if isinstance(mod, BackendModule):
            mod.to_stock()
            if isinstance(mod._parameters.get("weight"), torch.Tensor):
                kernels.unpack(mod.weight)


def fast_linear_enabled(model: nn.Module) -> bool:
    """Whether every linear layer of `model` is a PackedLinear (a layer it shares with another enabled model, such as
    a head's borrowed lm_head, does not make it so)."""
    mods = linears(model)
    return bool(mods) and all(isinstance(mod, PackedLinear) for mod in mods)
