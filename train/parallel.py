"""Several training processes (`accelerate launch`, `torchrun`): data parallel training with one writer.

    accelerate launch --num_processes 2 -m eagle_cli train --config configs/smollm2-135m-eagle1.yaml
    torchrun --nproc_per_node 2 -m eagle_cli train --config ...        # on CPUs too (gloo)

Every process holds the whole head and the target (replicated). An optimizer step takes `optim.accumulate`
micro-batches on every process: of the step's A x W micro-batches, process r of W takes micro-batches a * W + r.
Their gradients are averaged, over the micro-batches and then over the processes with one all-reduce, before the
step, so every replica takes the same step from the same weights: data parallelism as DDP does it. (DDP's wrapper
is not used: a training step runs the head several times, unrolled on its own outputs, before one backward, which
DDP's hooks do not allow.) One process with A micro-batches and A processes with one take the same steps, up to the
order of float32 sums. The step's metrics and its seconds travel in the same all-reduce, so every process decides
alike when to validate, save and stop; validation is sharded by process and its sums reduced the same way. The main
process alone writes checkpoints, logs, TensorBoard scalars and the best head, and prints.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass
class Ranks:
    index: int = 0  # this process
    count: int = 1  # processes in all

    @property
    def main(self) -> bool:
        return self.index == 0

    @classmethod
    def of(cls, accelerator) -> "Ranks":
        return cls(accelerator.process_index, accelerator.num_processes)

    def barrier(self) -> None:
        if self.count > 1:
            dist.barrier()

    def sum_(self, t: torch.Tensor) -> torch.Tensor:
        """`t` summed over the processes, in place."""
        if self.count > 1:
            dist.all_reduce(t)
        return t

    def gather(self, obj) -> list:
        """Every process's `obj`, in process order."""
        if self.count == 1:
            return [obj]
        out = [None] * self.count
        dist.all_gather_object(out, obj)
        return out

    def from_main(self, obj):
        """The main process's `obj`, on every process."""
        if self.count == 1:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]


def average_gradients(params: list[torch.Tensor], stats: list[float], ranks: Ranks) -> list[float]:
    """Average the gradients of `params` over the processes (in place; a parameter without one counts as zeros),
    and sum `stats` over them, in one all-reduce; returns the summed stats."""
    device = params[0].device
    if ranks.count == 1:
        return list(stats)
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
    flat = torch.cat([g.reshape(-1).float() for g in grads] + [torch.tensor(stats, dtype=torch.float32,
                                                                            device=device)])
    ranks.sum_(flat)
    at = 0
    for p, g in zip(params, grads):
        n = g.numel()
        p.grad = (flat[at:at + n] / ranks.count).view_as(g).to(g.dtype)
        at += n
    return flat[at:].tolist()
