"""The CPU backend: C kernels and measured matmul layouts that speed up stock torch modules on CPUs, from outside.

The EAGLE core (`eagle`: the head, target loading, checkpoints; `infer`'s cache and trees) is plain torch and
never imports this package; `infer`, `train` and `data_prep` reach it through this module only:

    import cpu_backend
    cpu_backend.enable(target.model, run=one_pass, gguf=target.source)  # measured layouts, layers in C
    cpu_backend.enable(head, drafts=True)      # the head's layers too, its own weights in low precision
    ...
    cpu_backend.disable(head)
    cpu_backend.disable(target.model)          # the stock classes again

Enabling gives that model's modules the backend's own classes (`cpu_backend.modules`: the same objects, parameters
and names, each with its plan in `cpu_plan`): every `nn.Linear` a PackedLinear that takes the layout measured fastest
on this machine (the C kernel's packed products, or torch's); RMS norms, gated MLPs, Llama-style attention, whole
decoder layers and all the layers of a base model KernelNorm, KernelMLP, KernelAttention, FusedLayer and FusedStack,
in C where a check on random inputs shows they compute what the stock module computes. Every
output row is computed alone, so a verification pass gives each token the bits a one-token step gives it. Besides,
the decoder takes greedy tokens through `Screen` (an int8 screen of the lm_head that gives the argmax of the
kernel's logits bit for bit), greedy head drafts through `greedy_chain`, and KV compaction through `compact_kv`.

Settings: `CPUConfig` (per decoder, evaluation or training run: the backend on or off, greedy screens), and for the
kernels' paths `Switches` (`cpu_backend.switches`: one object, read from EAGLE_NO_KERNEL, EAGLE_NO_Q4, EAGLE_NO_AMX,
EAGLE_NO_VNNI, EAGLE_BF16_DRAFTS, EAGLE_REQUIRE_KERNEL and EAGLE_RECALIBRATE at `enable`, or chosen with
`cpu_backend.switches.use(Switches(...))`; docs/cpu-backend.md).
"""

from __future__ import annotations

import warnings
import weakref
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from cpu_backend import draft, fastpath, gguf_codes, kernels, modules, parts, switches
from cpu_backend.attention import MAX_ROWS as PREFILL_ROWS  # rows a pass may bring to the C attention and layers
from cpu_backend.kernels import KernelError, available
from cpu_backend.plan import Plan
from cpu_backend.switches import Switches
from eagle.head import EagleHead

__all__ = ["CPUConfig", "Switches", "Route", "routes", "Screen", "available", "enable", "disable", "enabled",
           "applies", "greedy_chain", "compact_kv", "plan_training", "PREFILL_ROWS", "KernelError"]


@dataclass
class CPUConfig:
    # the backend on the CPU: measured layouts, C kernels for products, norms, MLPs, attention and whole layers;
    # false: the stock torch modules throughout
    fast_path: bool = True
    # with the fast path, greedy tokens read the lm_head in int8 and recompute in float32 only the few rows that can
    # be the largest: the argmax of the kernel's logits, bit for bit, for a quarter of the lm_head's bytes
    # (`Screen`), and so do an EAGLE-1/2 head's greedy drafts over its draft rows; sampling reads the whole lm_head
    screen_argmax: bool = True


def applies(model: nn.Module) -> bool:
    """Whether the backend is for `model`: its weights are float32 and on the CPU (elsewhere the stock modules run:
    torch's own kernels, SDPA on GPUs)."""
    p = next(model.parameters(), None)
    return p is not None and p.device.type == "cpu" and p.dtype == torch.float32


_with_codes: weakref.WeakSet = weakref.WeakSet()  # models whose GGUF K-quant codes were read


def enable(model: nn.Module, *, plan: Plan | None = None, run=None, gguf: Path | None = None,
           drafts: bool = False) -> Plan:
    """The backend's classes for `model`'s modules (these objects): layouts from `plan`, else the cached or a fresh
    calibration (timing whole passes with `run(rows) -> seconds` when given: a few seconds once per machine); the
    K-quant codes of the GGUF file it was loaded from (`gguf`) read for the kernels; an EAGLE head's layers in C,
    and with `drafts` its own weights (not the target's lm_head and embedding it borrows) multiplied in int8 or
    bfloat16 while drafting. The switches (`cpu_backend.switches`) are read from the environment now, unless code
    chose them."""
    switches.refresh()
    if gguf is not None and model not in _with_codes:
        try:
            gguf_codes.attach(model, gguf)
        except Exception as e:  # noqa: BLE001 (only speed is at stake)
            warnings.warn(f"{gguf}: K-quant codes not read ({type(e).__name__}: {e}); float32 weights are used")
        _with_codes.add(model)
    plan = fastpath.enable_fast_linear(model, plan, run)
    if isinstance(model, EagleHead):
        draft.patch(model)
        kernels.draft_precision(_own_weights(model), drafts)
    return plan


def disable(model: nn.Module) -> None:
    """The stock classes of `model`'s modules again, and the memory of the kernels' copies of its weights."""
    if isinstance(model, EagleHead):
        kernels.draft_precision(_own_weights(model), False)
        draft.unpatch(model)
    fastpath.disable_fast_linear(model)


def enabled(model: nn.Module) -> bool:
    return fastpath.fast_linear_enabled(model)


@dataclass
class Route:
    """What runs one backend module of a model (`routes`)."""

    module: str  # its name in the model
    runs: str    # the backend's class (the stock class)
    plan: str    # where its C runs: its plan (row counts, ...)
    weight: str  # how the kernels read its weight (`kernels.read_as`; "" where none was read yet)

    @staticmethod
    def table(routes: list["Route"]) -> str:
        """The routes as aligned text, after a line on the paths the switches and this CPU allow."""
        c = available()
        head = (f"C kernels: {c}; Q4_1 codes: {switches.current().q4_1}; AMX tiles: {c and kernels.amx_on()}; "
                f"VNNI byte products: {c and kernels.vnni_on()}; (float32 on the CPU, no gradients)")
        rows = [("module", "runs", "plan", "weight read as")] + [(r.module, r.runs, r.plan, r.weight) for r in routes]
        width = [max(len(row[i]) for row in rows) for i in range(3)]
        return "\n".join([head, *("  ".join(c.ljust(w) for c, w in zip(row[:3], width)) + "  " + row[3]
                                   for row in rows)])


def routes(model: nn.Module) -> list[Route]:
    """What runs where in an enabled `model`, one Route per backend module, read from the modules themselves: which
    backend class, at which row counts its C runs (its plan), how the kernels read its weight. Everything else (other
    dtypes, devices, gradients, larger inputs) runs the stock forward."""
    out = []
    for name, mod in model.named_modules():
        if isinstance(mod, modules.BackendModule):
            w = mod._parameters.get("weight")
            out.append(Route(name or type(model).__name__, mod._get_name(), mod.plan_repr(),
                             kernels.read_as(w) if isinstance(w, torch.Tensor) else ""))
    return out


def _own_weights(head: EagleHead) -> list[torch.Tensor]:
    shared = {id(m) for m in (head.lm_head, head.embed_tokens) if m is not None}
    return [m.weight for m in head.modules() if isinstance(m, nn.Linear) and id(m) not in shared]


def plan_training(model: nn.Module, rows: int) -> list[str]:
    """For training on the CPU: the enabled `model`'s products where gradients are wanted through the packed kernel
    or torch's, whichever was measured faster here for `rows` rows; returns the weight shapes left to torch."""
    timings = parts.plan_training(model, rows)
    return sorted(k for k, t in timings.items() if t["kernel"] >= t["linear"])


class Screen:
    """Greedy tokens of the products with `weight` in the layout of the PackedLinear `layer` (an lm_head,
    or an EAGLE-1/2 head's rows of it), through the int8 screen: the argmax of the kernel's logits, bit for bit."""

    def __init__(self, layer: nn.Module, weight: torch.Tensor):
        self.layer, self.weight = layer, weight

    @classmethod
    def of(cls, layer: nn.Module, weight: torch.Tensor | None = None) -> "Screen | None":
        """A screen where it can apply: a bias-free linear layer whose weight (or `weight`) the kernel takes."""
        w = layer.weight if weight is None else weight
        fits = (isinstance(layer, nn.Linear) and layer.bias is None and w is not None and kernels.available()
                and kernels.supports(w))
        return cls(layer, w) if fits else None

    def prepare(self, rows: int = 16) -> None:
        """Make the tables now (about a second for SmolLM2's lm_head), not in the first timed token."""
        kernels.screen_tables(self.weight, rows)

    def argmax(self, feats: torch.Tensor) -> torch.Tensor | None:
        """The argmax of `feats @ weight.T` [...] where the fast path multiplies this many rows by `layer` in the
        kernel (float32 features on the CPU, no gradients); else None (the caller takes the logits' argmax)."""
        if (feats.dtype == torch.float32 and feats.is_cpu
                and not (torch.is_grad_enabled() and (feats.requires_grad or self.weight.requires_grad))
                and parts.kernel_rows(self.layer, feats.numel() // feats.shape[-1])):
            return kernels.screen_argmax(feats, self.weight)
        return None


def greedy_chain(head: EagleHead) -> draft.GreedySteps | None:
    """Greedy drafting steps in C for an enabled EAGLE-1/2 head (`draft.GreedySteps`), or None where its module
    path would not run these calls. Build them again for each decoding: they hold the weights' current layouts."""
    return draft.GreedySteps.build(head)


def compact_kv(layers, start: int, keep: torch.Tensor) -> bool:
    """Move every layer's cached keys and values at `start + keep` down to `start, start + 1, ...` in one C call,
    for a cache of PreallocatedLayers (`eagle.target`) of one sequence in float32 on the CPU; False (nothing done)
    where it does not apply."""
    table = _buffer_table(layers)
    if table is None:
        return False
    kernels.kv_compact(table, start, keep.to(torch.int64).contiguous())
    return True


_tables: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _buffer_table(layers) -> torch.Tensor | None:
    """`kernels.kv_compact`'s table of every layer's key and value buffers, made again when any buffer was made
    since (`PreallocatedLayer.buffers_made`)."""
    from eagle.target import PreallocatedLayer

    key = (PreallocatedLayer.buffers_made, len(layers), id(layers[0]) if layers else 0)
    kept = _tables.get(layers[0]) if layers else None
    if kept is not None and kept[0] == key:
        return kept[1]
    table = None
    if layers and kernels.available() and all(
            type(layer) is PreallocatedLayer and layer._k is not None and layer._k.shape[0] == 1
            and layer._k.dtype == torch.float32 and layer._k.is_cpu and layer._k.stride(3) == 1
            and layer._v.stride() == layer._k.stride() for layer in layers):
        table = torch.tensor([[t.data_ptr(), t.shape[1], t.stride(1), t.stride(2), t.shape[3]]
                              for layer in layers for t in (layer._k, layer._v)], dtype=torch.int64)
    if layers:
        _tables[layers[0]] = (key, table)
    return table
