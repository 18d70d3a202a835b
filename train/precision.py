"""The dtypes of a training run and the optimizer that steps its head: float32 master weights and AdamW states
whatever the target's dtype, the step's products in bfloat16 or float16 under autocast where asked (on CUDA by
default), and the loss scale float16 needs.

    precision = Precision.of(cfg, device, target)    # target / head / products / saved head
    optim = Optim.of(cfg, head, precision)
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from eagle import EagleHead, TargetModel
from eagle.device import resolve_dtype
from train.checkpoints import TrainState
from train.config import TrainConfig


@dataclass
class Precision:
    """The dtypes of a run, from its config and device: the target's weights (`model.dtype`; auto: bfloat16 on CUDA,
    else float32; a target handed in keeps its own), the head's master weights and AdamW states
    (`model.head_dtype`), a training step's products (`mixed_precision` under autocast; None: the head's dtype),
    and the head written to `out` (`model.save_dtype`; auto: the target's when it is 16-bit, else the head's)."""

    target: torch.dtype
    head: torch.dtype
    compute: torch.dtype | None
    save: torch.dtype

    @classmethod
    def of(cls, cfg: TrainConfig, device: torch.device, target: TargetModel | None = None) -> "Precision":
        cuda = device.type == "cuda"
        tdtype = target.dtype if target is not None else resolve_dtype(cfg.model.dtype, device)
        mp = ("bf16" if cuda else "none") if cfg.mixed_precision == "auto" else cfg.mixed_precision
        head = resolve_dtype(cfg.model.head_dtype)
        save = (tdtype if tdtype.itemsize == 2 else head) if cfg.model.save_dtype == "auto" else \
            resolve_dtype(cfg.model.save_dtype)
        return cls(tdtype, head, {"none": None, "bf16": torch.bfloat16, "fp16": torch.float16}[mp], save)

    @property
    def mixed_precision(self) -> str:
        return {None: "none", torch.bfloat16: "bf16", torch.float16: "fp16"}[self.compute]


@dataclass
class Optim:
    """What a step updates the head with: AdamW over its trainable parameters (in the head's dtype: float32 master
    weights by default), the loss scaler float16 products need so that small gradients do not vanish (a
    pass-through otherwise), and the run's precision (the products' autocast dtype; the saved head's dtype)."""

    opt: torch.optim.Optimizer
    params: list[torch.Tensor]
    scaler: torch.amp.GradScaler
    precision: Precision

    @classmethod
    def of(cls, cfg: TrainConfig, head: EagleHead, precision: Precision) -> "Optim":
        params = [p for n, p in head.named_parameters()
                  if p.requires_grad and not n.startswith(("embed_tokens.", "lm_head."))]
        opt = torch.optim.AdamW(params, lr=cfg.optim.lr, betas=tuple(cfg.optim.betas),
                                weight_decay=cfg.optim.weight_decay)
        device = params[0].device.type
        return cls(opt, params, torch.amp.GradScaler(device, enabled=precision.compute == torch.float16), precision)

    def save(self, folder: Path, state: TrainState) -> None:
        torch.save(self.opt.state_dict(), folder / "optimizer.pt")
        if self.scaler.is_enabled():
            state.loss_scale = self.scaler.state_dict()

    def load(self, folder: Path, state: TrainState) -> None:
        self.opt.load_state_dict(torch.load(folder / "optimizer.pt", map_location="cpu", weights_only=True))
        if self.scaler.is_enabled() and state.loss_scale:
            self.scaler.load_state_dict(state.loss_scale)
