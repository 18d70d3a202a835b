"""The backend's modules for a decoder layer's parts: `PackedLinear` (an `nn.Linear` whose products take the
measured layout for their row count), `KernelNorm` (an RMS norm in one C call) and `KernelMLP` (a gated MLP's gate
and up products and activation in one C call), with the checks that decide where they apply and, for training on
the CPU, the packed products with gradients (`train_linear`, `plan_training`).

Their forwards run ~200 times a decoding step, where every torch or Python operation costs a few microseconds on
this machine, so they check cheap attributes (`is_cpu`, not `device.type`) and call the kernel with the input's own
shape (no reshape / view around it).
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from cpu_backend import kernels
from cpu_backend.modules import BackendModule, row_spans
from cpu_backend.plan import MAX_ROWS, apply, cache_path, cached_json, fitting, linears, shape_key

@dataclass
class LinearPlan:
    by_rows: list[str]  # the layout for each row count 0 .. MAX_ROWS (the last for more), checked to fit the weight
    train: bool = True  # products autograd records through the packed kernel (`plan_training`), else F.linear


class PackedLinear(BackendModule):
    """An `nn.Linear` whose products take the layout the plan measured fastest for their row count: the packed
    C kernel (on GGUF codes, AMX tiles or byte products where the weight and the CPU allow), `F.linear`, or
    `(W @ x.T).T`; with gradients, `train_linear` or `F.linear` (`plan_training`)."""

    cpu_plan: LinearPlan

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.weight
        if not x.is_cpu:
            return F.linear(x, w, self.bias)
        if wants_grad(x, w):
            return _grad_linear(self, x, w, self.bias)
        layout = self.cpu_plan.by_rows[row_index(x)]  # layouts checked to fit when planned
        if layout != "kernel" and kernels.in_draft_precision(w):  # the plan measured float32; drafts read less
            layout = "kernel"
        return apply(x, w, self.bias, layout)

    def plan_repr(self) -> str:
        return f"kernel at {row_spans([layout == 'kernel' for layout in self.cpu_plan.by_rows])} rows"


def train_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """`F.linear` where gradients are wanted: its forward and backward products through the packed kernel
    (`kernels.linear_with_grad`) for float32 on the CPU with the kernel built, else `F.linear` itself."""
    if (x.dtype == weight.dtype == torch.float32 and x.is_cpu and weight.is_cpu and x.dim() >= 2
            and kernels.available()):
        return kernels.linear_with_grad(x, weight, bias)
    return F.linear(x, weight, bias)


def _grad_linear(mod: nn.Module, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """A product autograd records for the PackedLinear `mod`: through `train_linear` unless `plan_training` measured
    `F.linear` faster for its weight shape."""
    return train_linear(x, weight, bias) if mod.cpu_plan.train else F.linear(x, weight, bias)


def wants_grad(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether autograd records this product (training)."""
    return torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)


def row_index(x: torch.Tensor) -> int:
    """Index into a LinearPlan's `by_rows`: x's rows, or MAX_ROWS for more (the largest bucket's layout)."""
    rows = x.numel() // x.shape[-1]
    return rows if rows < MAX_ROWS else MAX_ROWS


def stock_path(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether a backend module must run its stock forward for this input (training, other devices or dtypes)."""
    return not x.is_cpu or x.dtype != torch.float32 or wants_grad(x, weight)


@dataclass
class NormPlan:
    eps: float
    offset: float = 0.0  # 1.0 for Gemma's norms, which scale by 1 + weight


def norm_weight(norm: nn.Module, plan: NormPlan | None = None) -> torch.Tensor:
    """The scale an RMS norm's kernel applies (`plan`, else the KernelNorm's own): its weight, or for Gemma's norms
    1 + weight as their forward makes it, in float32, kept beside the weight as the packed copies are
    (`kernels.kept`)."""
    w = norm._parameters["weight"]  # not the module attribute: ~3-5 us a read here, six a Gemma layer a pass
    offset = (plan or norm.cpu_plan).offset
    return kernels.kept(w, "plus_offset", lambda t: (t + offset).detach(), offset) if offset else w


def norm_kernel(mod: nn.Module, x: torch.Tensor, plan: NormPlan) -> torch.Tensor:
    return kernels.rms_norm(x, norm_weight(mod, plan), plan.eps)


class KernelNorm(BackendModule):
    """An RMS norm in one C call (`kernels.rms_norm`) for float32 rows on the CPU without gradients."""

    cpu_plan: NormPlan

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.stock_forward(x) if stock_path(x, self.weight) else norm_kernel(self, x, self.cpu_plan)

    def plan_repr(self) -> str:
        return f"eps={self.cpu_plan.eps}" + (", scale 1 + weight" if self.cpu_plan.offset else "")


@dataclass
class MLPPlan:
    act: int  # `rows_gated`'s activation: 0 SiLU, kernels.GELU_TANH


def mlp_kernel(mod: nn.Module, x: torch.Tensor, plan: MLPPlan) -> torch.Tensor:
    return mod.down_proj(kernels.rows_gated(x, mod.gate_proj.weight, mod.up_proj.weight, plan.act))


class KernelMLP(BackendModule):
    """A gated MLP with its gate and up products and the activation in one C call (`kernels.rows_gated`) at the row
    counts where the plan chose the kernel for its gate projection; its down projection a PackedLinear."""

    cpu_plan: MLPPlan

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate = self.gate_proj
        if stock_path(x, gate.weight) or gate.cpu_plan.by_rows[row_index(x)] != "kernel":
            return self.stock_forward(x)  # its linear layers still take their measured layouts
        return mlp_kernel(self, x, self.cpu_plan)

    def plan_repr(self) -> str:
        return "gelu_tanh" if self.cpu_plan.act == kernels.GELU_TANH else "silu"


def norm_eps(mod: nn.Module) -> float | None:
    """The epsilon of an RMS norm module (transformers' `variance_epsilon` / `eps`), else None."""
    if not type(mod).__name__.endswith("RMSNorm") or not isinstance(getattr(mod, "weight", None), torch.Tensor):
        return None
    eps = getattr(mod, "variance_epsilon", getattr(mod, "eps", None))
    return float(eps) if isinstance(eps, float) else None


def gated_mlp_act(mod: nn.Module) -> int | None:
    """`rows_gated`'s act when `mod` is `down_proj(act_fn(gate_proj(x)) * up_proj(x))` with bias-free linear layers
    and SiLU (0: Llama, Qwen, Mistral, our heads, whose `act_fn` may be missing as their forward applies SiLU
    itself) or GELU's tanh form (`kernels.GELU_TANH`: Gemma's); else None."""
    parts = [getattr(mod, n, None) for n in ("gate_proj", "up_proj", "down_proj")]
    if not all(isinstance(p, nn.Linear) and p.bias is None and kernels.supports(p.weight) for p in parts):
        return None
    act = getattr(mod, "act_fn", None)
    if act is None:
        return 0
    t = torch.linspace(-6, 6, 97)
    try:
        y = act(t)
    except (TypeError, RuntimeError):
        return None
    if torch.allclose(y, F.silu(t), atol=1e-6):
        return 0
    return kernels.GELU_TANH if torch.allclose(y, F.gelu(t, approximate="tanh"), atol=1e-6) else None


def same_as_stock(mod: nn.Module, kernel, width: int, plan) -> bool:
    """Whether `kernel` with `plan` computes what the module's stock forward computes, on a random input of a few
    rows: the check that keeps a module whose forward differs from what its name and parts suggest (Gemma's
    `1 + weight` norm, another activation) on its stock forward."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(1, 3, width, generator=gen) * 2 + 0.5
    with torch.no_grad():
        want, got = type(mod).forward(mod, x), kernel(mod, x, plan)
    return got.shape == want.shape and torch.allclose(got, want, rtol=1e-4, atol=1e-4 * width ** 0.5)


def linear_as(mod: nn.Module, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """`F.linear(x, weight)` in the layout the PackedLinear `mod` uses for this many rows (the stock product when
    `mod` is not one): for a product that is not a layer of its own, such as an EAGLE-1 head's logits over the
    target's lm_head rows of its draft vocabulary."""
    if not isinstance(mod, PackedLinear):
        return F.linear(x, weight)
    if x.is_cpu and wants_grad(x, weight):
        return _grad_linear(mod, x, weight, None)
    if stock_path(x, weight):
        return F.linear(x, weight)
    return apply(x, weight, None, fitting(mod.cpu_plan.by_rows[row_index(x)], weight))


def kernel_rows(mod: nn.Module, rows: int) -> bool:
    """Whether the PackedLinear `mod` multiplies `rows` rows through the packed kernel (False when it is not one)."""
    return isinstance(mod, PackedLinear) and mod.cpu_plan.by_rows[min(rows, MAX_ROWS)] == "kernel"


def plan_training(model: nn.Module, rows: int = 1024, repeats: int = 2) -> dict[str, dict[str, float]]:
    """Choose, per weight shape of the enabled `model`, how its products run where gradients are wanted: the packed
    kernel's forward and backward (`train_linear`) or `F.linear`'s, whichever took less time for `rows` rows (ms,
    median of `repeats` after a warm-up, a fresh copy of the weight each time, as an optimizer step makes the kernel
    repack it; a few seconds, once per machine). The kernel won 1.7x on a 2-core AVX-512 machine and lost 1.1-1.4x
    on an AVX2 one (BENCHMARKS.md). Timings are cached per machine like the plan's; returns them."""
    weights = {shape_key(m.weight): m.weight for m in linears(model)}  # one per shape
    timings = cached_json(cache_path(model, f"train{rows}"),
                           lambda: {key: _time_training(w, rows, repeats) for key, w in weights.items()})
    for mod in linears(model):
        if isinstance(mod, PackedLinear):
            t = timings.get(shape_key(mod.weight))
            mod.cpu_plan.train = t is not None and t["kernel"] < t["linear"]
    return timings


def _time_training(w0: torch.Tensor, rows: int, repeats: int) -> dict[str, float]:
    gen = torch.Generator(device="cpu").manual_seed(rows)  # leaves the global RNG alone
    x = torch.randn(rows, w0.shape[1], generator=gen).requires_grad_()
    gy = torch.randn(rows, w0.shape[0], generator=gen)
    times = {}
    for name, fn in (("kernel", train_linear), ("linear", F.linear)):
        samples = []
        for r in range(repeats + 1):
            w = w0.detach().float().clone().requires_grad_(w0.requires_grad)  # a frozen weight gets no dW
            t0 = time.perf_counter()
            fn(x, w, None).backward(gy)
            if r:
                samples.append((time.perf_counter() - t0) * 1e3)
        times[name] = round(statistics.median(samples), 3)
    return times


def patch(model: nn.Module) -> None:
    """Give the RMS norms and gated MLPs of `model` on the CPU KernelNorm and KernelMLP where the kernels compute
    what their stock forward does (an MLP after its linear layers are PackedLinears)."""
    for mod in stock_modules_on_cpu(model):
        eps = norm_eps(mod)
        if eps is not None and mod.weight.dim() == 1 and kernels.supports(mod.weight[None]):
            width = mod.weight.shape[0]
            plan = next((p for p in (NormPlan(eps), NormPlan(eps, offset=1.0))  # Gemma's norms scale by 1 + weight
                         if same_as_stock(mod, norm_kernel, width, p)), None)
            if plan is not None:
                KernelNorm.from_stock(mod, plan)
        elif ((act := gated_mlp_act(mod)) is not None and isinstance(mod.gate_proj, PackedLinear)
              and "kernel" in mod.gate_proj.cpu_plan.by_rows):
            if same_as_stock(mod, mlp_kernel, mod.gate_proj.weight.shape[1], MLPPlan(act)):
                KernelMLP.from_stock(mod, MLPPlan(act))


def stock_modules_on_cpu(model: nn.Module):
    """The modules of `model` with parameters on the CPU that have their stock class."""
    for mod in model.modules():
        first = next(mod.parameters(), None)
        if not isinstance(mod, BackendModule) and first is not None and first.device.type == "cpu":
            yield mod
