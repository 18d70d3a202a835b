"""The speculators library's config (`speculators_model_type`, `transformer_layer_config`, `speculators_config`) as
the flat Llama-style config vLLM builds of it: read by `eagle.interop` (loading a head) and `eagle.contracts`
(checking one). vLLM 0.32.0's reading: `vllm/transformers_utils/configs/speculators/{base,algos}.py`."""

from __future__ import annotations

from eagle.checkpoint import CheckpointError


def is_speculators(raw: dict) -> bool:
    return "speculators_model_type" in raw


def flatten_speculators(raw: dict, path) -> dict:
    """A speculators config as the Llama-style config of its draft layer, with the EAGLE-3 keys beside it (what vLLM
    builds of it)."""
    if raw.get("speculators_model_type") != "eagle3":
        raise CheckpointError(f"draft head {str(path)!r}: speculators_model_type "
                              f"{raw.get('speculators_model_type')!r}: only eagle3 heads are read")
    flat = dict(raw.get("transformer_layer_config") or {})
    for key in ("draft_vocab_size", "target_hidden_size", "eagle_aux_hidden_state_layer_ids", "fc_norm",
                "norm_output", "norm_before_fc"):
        if raw.get(key) is not None:
            flat[key] = raw[key]
    flat["norm_before_residual"] = raw.get("norm_before_residual", True)  # vLLM's default for speculators
    flat["architectures"] = ["LlamaForCausalLMEagle3"]
    return flat
