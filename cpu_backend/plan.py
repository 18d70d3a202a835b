"""The measured matmul layouts of the CPU backend: which product each `nn.Linear` weight shape takes at each row
count (`Plan`), the layouts themselves, and the plan's cache file per machine.

    plan.layout(weight, rows)        # "linear" (F.linear), "wxt" ((W @ x.T).T) or "kernel" (the packed C kernel)
    apply(x, weight, bias, layout)   # the product in that layout

`cpu_backend.fastpath.calibrate` measures a Plan; `cached_json` keeps it under `$EAGLE_CACHE/fastpath/`.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from cpu_backend import kernels, switches
from eagle.target import cache_root

# row counts measured; a call uses the plan of the smallest bucket >= its rows. Up to 256: batched regeneration
# (data_prep) multiplies each weight by one row per sequence of its batch, where the packed kernel beat MKL too.
BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
MAX_ROWS = BUCKETS[-1]
# "linear": F.linear; "wxt": (W @ x.T).T; "kernel": cpu_backend.kernels's C kernel (where it builds and fits the shape)
LAYOUTS = ("linear", "wxt", "kernel")
# the kernel is kept unless another layout is this much faster: with it a verification pass gives every token the
# bits of a single step and a decoder layer runs in one C call, and on this noisy machine a one-off calibration
# has picked another layout on a 0.3-4 % difference that reversed when measured again (BENCHMARKS.md)
KERNEL_MARGIN = 1.05


def available_layouts() -> tuple[str, ...]:
    return LAYOUTS if kernels.available() else tuple(x for x in LAYOUTS if x != "kernel")


def _wxt(x2: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x2 [M, in] -> [M, out] computed as (W @ x2.T).T; one row is padded to two (MKL's gemv path is slow)."""
    m = x2.shape[0]
    xt = (x2.repeat(2, 1) if m == 1 else x2).t()  # a real copy: a stride-0 expand is slower still
    y = torch.mm(weight, xt) if bias is None else torch.addmm(bias[:, None], weight, xt)
    return y[:, :m].t().contiguous()


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, layout: str) -> torch.Tensor:
    """`F.linear(x, weight, bias)` through the named layout (the stock one where the kernel does not fit)."""
    return apply(x, weight, bias, fitting(layout, weight))


def fitting(layout: str, weight: torch.Tensor) -> str:
    """`layout`, or "linear" where it is the kernel and the kernel cannot take this weight here."""
    fits = layout != "kernel" or (kernels.supports(weight) and kernels.available())
    return layout if fits else "linear"


def apply(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, layout: str) -> torch.Tensor:
    if layout == "kernel" and x.dtype == torch.float32:
        return kernels.rows_linear(x, weight, bias)
    if layout == "wxt":
        return _wxt(x.reshape(-1, x.shape[-1]), weight, bias).view(*x.shape[:-1], weight.shape[0])
    return F.linear(x, weight, bias)


@dataclass
class Plan:
    """The chosen layout per weight shape and row bucket, with the timings behind each choice (ms per sweep)."""

    layouts: dict[str, dict[int, str]] = field(default_factory=dict)     # "out x in" -> bucket -> layout
    timings: dict[str, dict[int, dict[str, float]]] = field(default_factory=dict)

    def layout(self, weight: torch.Tensor, rows: int) -> str:
        by_bucket = self.layouts.get(shape_key(weight))
        if not by_bucket:
            return "linear"
        # the smallest bucket measured that holds `rows`, the largest beyond them all
        return by_bucket[min((b for b in by_bucket if b >= rows), default=max(by_bucket))]

    def to_json(self) -> dict:
        return {"layouts": self.layouts, "timings": self.timings}

    @classmethod
    def from_json(cls, d: dict) -> "Plan":
        return cls(layouts={s: {int(b): v for b, v in d2.items()} for s, d2 in d["layouts"].items()},
                   timings={s: {int(b): v for b, v in d2.items()} for s, d2 in d["timings"].items()})


def shape_key(weight: torch.Tensor) -> str:
    return f"{weight.shape[0]}x{weight.shape[1]}"


def linears(model: nn.Module) -> list[nn.Linear]:
    return [m for m in model.modules() if isinstance(m, nn.Linear)]


def cache_path(model: nn.Module, how: str) -> str:
    shapes = sorted({shape_key(m.weight) + str(m.weight.dtype) for m in linears(model)})
    # a changed kernel, or a switch that routes products through other code (EAGLE_NO_AMX, ...), plans anew
    ident = json.dumps([platform.processor() or platform.machine(), _cpu_name(), torch.get_num_threads(),
                        torch.__version__, shapes, how, available_layouts(), kernels.path_key(), BUCKETS,
                        KERNEL_MARGIN])
    return str(cache_root() / "fastpath" / f"{hashlib.sha1(ident.encode()).hexdigest()[:16]}.json")


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), "")
    except OSError:
        return ""


def cached_json(path: str, make: Callable[[], dict]) -> dict:
    """The JSON object cached at `path`, or `make()`'s, written there whole (temp file + rename) for next time.
    EAGLE_RECALIBRATE=1 measures again whatever is cached."""
    if os.path.exists(path) and not switches.current().recalibrate:
        with open(path) as f:
            return json.load(f)
    obj = make()
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=1)
    os.replace(tmp, path)
    return obj
