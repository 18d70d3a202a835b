"""Targets of other families than Llama (MISSION: Qwen2 / Qwen3, Mistral, Gemma at least; Gemma-3 runs on the real
gemma3-270m in test_gemma.py): tiny random models of each, float32 so the fast path's kernels and its checks
against the stock layers run, decoding exactly as transformers' own greedy `generate`."""

import pytest
import torch
from tiny import tiny_head, tiny_tokenizer
from transformers import (FalconConfig, Gemma3Config, Gemma3TextConfig, GPT2Config, LlamaConfig, MistralConfig,
                          Phi3Config, Qwen2Config, Qwen3Config, SiglipVisionConfig)
from transformers import AutoModelForCausalLM

from eagle import TargetModel
from cpu_backend import CPUConfig
from infer import SpeculativeDecoder

PROMPT = [5, 6, 7, 8, 9, 10, 11, 5, 6]
FAMILIES = {
    "llama": (LlamaConfig, {}),
    "qwen2": (Qwen2Config, {}),  # biases on q / k / v
    "qwen3": (Qwen3Config, {"head_dim": 32}),  # q / k norms inside attention (32 wide: the norm kernel takes them)
    "mistral": (MistralConfig, {"sliding_window": 5}),  # a window every layer keeps, shorter than the text
    # a `layer_types` in the config that Mistral's model never reads: the window still holds for every layer, and
    # the model gets one mask, not masks by type
    "mistral-typed": (MistralConfig, {"sliding_window": 5, "layer_types": ["full_attention"] * 2}),
    # norms of 1 + weight (four a layer, and q / k norms), GELU, sliding-window layers, scaled embeddings
    "gemma3": (Gemma3TextConfig, {"head_dim": 32, "sliding_window": 4, "query_pre_attn_scalar": 32}),
    # what AutoModelForCausalLM makes of Gemma-3 4B and up: Gemma3ForConditionalGeneration, a vision tower beside the
    # text decoder, whose sizes, window and layer types sit in a nested text config
    "gemma3-multimodal": (Gemma3Config, {"head_dim": 32, "sliding_window": 4, "query_pre_attn_scalar": 32}),
    "phi3": (Phi3Config, {}),  # q / k / v in one qkv_proj, gate and up in one gate_up_proj
    # no Llama-style decoder layers: the stock forward runs; no intermediate_size in the config for the head to copy
    "gpt2": (GPT2Config, {"n_embd": 64, "n_layer": 2, "n_head": 4, "n_positions": 512}),
    "falcon": (FalconConfig, {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4}),
}
SIZES = dict(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=512)


def tiny_family(family: str, seed: int = 0) -> TargetModel:
    torch.manual_seed(seed)
    tok = tiny_tokenizer(96)
    cls, extra = FAMILIES[family]
    common = dict(eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, tie_word_embeddings=False)
    text_cls = Gemma3TextConfig if cls is Gemma3Config else cls
    sizes = {"vocab_size": 96} if cls in (GPT2Config, FalconConfig) else SIZES  # their own names, in `extra`
    cfg = text_cls(**sizes, **common, **extra)
    if cls is Gemma3Config:
        torch.manual_seed(seed + 1)  # seed 0's model ends its greedy text at the third token
        vision = SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                                    image_size=28, patch_size=14)
        cfg = cls(text_config=cfg.to_dict(), vision_config=vision.to_dict(), mm_tokens_per_image=4,
                  image_token_index=95, boi_token_index=93, eoi_token_index=94, **common)
    model = AutoModelForCausalLM.from_config(cfg).float().eval().requires_grad_(False)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0, 0.5)  # Qwen2's q / k / v biases start at zero: make them count
        model.lm_head.weight.mul_(8.0)  # sharp distributions: greedy tokens are not near-ties
    return TargetModel(name=f"tiny-{family}", model=model, tokenizer=tok)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_every_family_decodes_as_transformers_greedy(family):
    target = tiny_family(family)
    ids = torch.tensor([PROMPT])
    hf = target.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=32, do_sample=False,
                               eos_token_id=target.eos_ids, pad_token_id=1)[0, len(PROMPT):].tolist()
    plain = SpeculativeDecoder(target, None).generate(PROMPT, 32, speculative=False)
    assert plain.token_ids == hf[: len(plain.token_ids)] and len(plain.token_ids) in (len(hf), 32)
    dec = SpeculativeDecoder(target, tiny_head(target).float())
    for cfg in (dict(num_speculative_tokens=3), dict(mode="dynamic", top_k=2, depth=3, total_tokens=6),
                dict(num_speculative_tokens=2, prompt_lookup_num_tokens=4)):
        assert dec.generate(PROMPT, 32, **cfg).token_ids == plain.token_ids, cfg
    # attention modules with q / k norms (Qwen3, Gemma-3) run the kernel attention too, norms included
    if family not in ("phi3", "gpt2", "falcon"):
        assert type(target.base.layers[0].self_attn).__name__ == "KernelAttention"
    stock = dec.generate(PROMPT, 32, num_speculative_tokens=3, cpu=CPUConfig(fast_path=False))
    assert stock.token_ids == plain.token_ids
    if family == "gemma3-multimodal":  # stop tokens from the model's config and its text config, each once
        target.model.config.eos_token_id, target.config.eos_token_id = [tiny_tokenizer(96).eos_token_id, 90], 91
        assert sorted(target.eos_ids) == sorted([tiny_tokenizer(96).eos_token_id, 90, 91])


@pytest.mark.parametrize("family", ["gemma3", "qwen3"])
def test_layers_with_qk_norms_run_in_one_call_with_their_parts_bits(family):
    """Gemma-3's decoder layers (four norms of 1 + weight, two of them on the attention's and the MLP's outputs, q / k
    norms, GELU) and Qwen3's (q / k norms) run in one C call each on a tree-masked pass, and their attention modules
    in one call without them: exactly the numbers of their parts."""
    from tests.test_attention import _verify_logits
    from torch import nn

    from cpu_backend import kernels
    from eagle.attention import use_gqa_sdpa
    from cpu_backend.fastpath import disable_fast_linear, enable_fast_linear
    from cpu_backend.fused import FusedLayer, KernelAttention
    from cpu_backend.parts import KernelMLP
    from cpu_backend.plan import BUCKETS, Plan
    from cpu_backend.modules import BackendModule

    target = tiny_family(family)
    plan = Plan(layouts={f"{m.weight.shape[0]}x{m.weight.shape[1]}": {b: "kernel" for b in BUCKETS}
                         for m in target.model.modules() if isinstance(m, nn.Linear)})
    use_gqa_sdpa(target.model, True)
    enable_fast_linear(target.model, plan)
    layers = list(target.base.layers)
    assert all(isinstance(layer, FusedLayer) and isinstance(layer.self_attn, KernelAttention)
               and isinstance(layer.mlp, KernelMLP) for layer in layers)
    assert layers[0].mlp.cpu_plan.act == (kernels.GELU_TANH if family == "gemma3" else 0)
    assert not isinstance(target.base, BackendModule)  # not all layers in one call: its table has no q / k norms
    g = torch.Generator().manual_seed(5)
    prefix, nodes = torch.randint(4, 90, (1, 9), generator=g), torch.randint(4, 90, (1, 6), generator=g)
    parents = torch.tensor([-1, 0, 0, 1, 2, 4])
    calls, one_call = [], kernels.decoder_layer
    with torch.no_grad():
        kernels.decoder_layer = lambda x, *a, **k: calls.append(x.shape[1]) or one_call(x, *a, **k)
        try:
            one_call_layers = _verify_logits(target, prefix, nodes, parents)
        finally:
            kernels.decoder_layer = one_call
        assert calls == [6, 6]  # the tree pass; the prefill's causal mask is sdpa's is_causal: the layers' parts
        for layer in layers:
            layer.to_stock()
        fused_attention = _verify_logits(target, prefix, nodes, parents)
        for layer in layers:
            layer.self_attn.to_stock()
        parts = _verify_logits(target, prefix, nodes, parents)
    assert torch.equal(one_call_layers, parts) and torch.equal(fused_attention, parts)
    disable_fast_linear(target.model)
    use_gqa_sdpa(target.model, False)
