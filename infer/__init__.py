"""Speculative decoding with EAGLE heads: drafting, tree/chain verification, acceptance, KV-cache reuse.

    from infer import SpeculativeDecoder
    dec = SpeculativeDecoder.from_pretrained("smollm2-135m", "runs/demo/head", num_speculative_tokens=4)
    out = dec.generate("Hello!", max_new_tokens=64)

This package imports `eagle` and the CPU backend's door (`cpu_backend`).
"""

from infer.decoder import DecodeConfig, GenerateOutput, SpeculativeDecoder
from infer.evaluate import load_prompts

__all__ = ["SpeculativeDecoder", "DecodeConfig", "GenerateOutput", "load_prompts"]
