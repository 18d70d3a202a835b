"""An independent reference for losslessness: the target's greedy tokens from stock transformers.

Comparing speculative decoding with our own plain decoding shows that speculation changes nothing, but a bug both
share (a kernel's wrong scale, a rotary error) would pass unseen. The reference is a model loaded on its own and
never handed to our decoder or the CPU backend, decoded by transformers' `generate` (greedy), so it shares no code
with the engine past transformers itself.

    ref = HFReference.load("smollm2-135m")
    r = ref.greedy(prompt_ids, max_new_tokens=128, stop_ids=[2])
    mismatch = first_mismatch(ours, r)        # None, or where the two part and the reference's top-2 margin there

A mismatch where the reference's two best logits are within rounding of each other (bf16, or another summation
order) is a near-tie, not a bug: the margin says which.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from eagle import TargetModel, load_target


@dataclass
class ReferenceOutput:
    token_ids: list[int]  # new tokens only, the stop token included
    margins: list[float] = field(default_factory=list)  # top-1 minus top-2 logit at each new token


@dataclass
class Mismatch:
    position: int  # index among the new tokens where the outputs first differ
    ours: int | None  # our token there (None: our output ended before)
    reference: int | None  # the reference's (None: it ended before)
    margin: float | None  # the reference's top-1 minus top-2 logit there (None where it had ended)


class HFReference:
    """A target's stock transformers model, decoded greedily by `generate`."""

    def __init__(self, target: TargetModel):
        self.target = target

    @classmethod
    def load(cls, name: str, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32) -> "HFReference":
        """A fresh copy of target `name` (alias, .gguf, directory or hub id), separate from any the engine holds."""
        return cls(load_target(name, device=device, dtype=dtype))

    @torch.inference_mode()
    def greedy(self, prompt_ids: list[int], max_new_tokens: int, stop_ids: list[int]) -> ReferenceOutput:
        """Up to `max_new_tokens` greedy tokens after `prompt_ids` (fewer at the context length), ending at the first
        of `stop_ids`."""
        from transformers import GenerationConfig

        t = self.target
        n = min(max_new_tokens, t.max_length - len(prompt_ids))
        if n < 1:
            return ReferenceOutput([])
        ids = torch.tensor([prompt_ids], device=t.device)
        pad = t.tokenizer.pad_token_id if t.tokenizer.pad_token_id is not None else stop_ids[0]
        cfg = GenerationConfig(max_new_tokens=n, do_sample=False, eos_token_id=list(stop_ids), pad_token_id=pad,
                               output_logits=True, return_dict_in_generate=True)
        out = t.model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=cfg)
        tokens = out.sequences[0, ids.shape[1]:].tolist()
        top2 = [step[0].float().topk(2).values for step in out.logits]
        return ReferenceOutput(tokens, [float(v[0] - v[1]) for v in top2])


def first_mismatch(ours: list[int], ref: ReferenceOutput) -> Mismatch | None:
    """Where `ours` and the reference's tokens first differ (one output ending before the other counts), or None."""
    theirs = ref.token_ids
    for i in range(max(len(ours), len(theirs))):
        a = ours[i] if i < len(ours) else None
        b = theirs[i] if i < len(theirs) else None
        if a != b:
            return Mismatch(i, a, b, ref.margins[i] if i < len(ref.margins) else None)
    return None
