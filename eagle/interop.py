"""Heads in the published EAGLE layouts: read them as ours, and write ours in them (what vLLM and SGLang load).

- EAGLE-1/2 (`yuhuili/EAGLE-*`): a Llama-style `config.json` (`hidden_size`, `num_attention_heads`, ...,
  `num_hidden_layers`, `bias` for the fc bias) and `fc.*`, `layers.N.*` weights, layer 0 without an input norm.
  Our key names are the same; the draft vocabulary of a reduced EAGLE-1 head has no place there, so an exported
  head drafts over the whole vocabulary.
- EAGLE-3 (`architectures: ["LlamaForCausalLMEagle3"]`): `fc.weight` (3H -> H), `midlayer.*` (our `layers.0.*`),
  `norm.weight`, `lm_head.weight` over the draft vocabulary (our `draft_head.weight`), `d2t` as offsets (target id
  = draft index + d2t[index]; ours holds the target ids), `t2d` a boolean mask over the target vocabulary. The fused
  layers: a top-level `eagle_aux_hidden_state_layer_ids` is indexed like transformers' `hidden_states` tuple (a
  layer's input, as vLLM and llama.cpp read it, and as ours are); `eagle_config.eagle_aux_hidden_state_layer_ids`
  names layer outputs (SGLang and SpecForge: index + 1). Export writes both; reading prefers the top-level key.
  Without either, EAGLE-3's default 2, L // 2, L - 3 of the target (eagle.contracts has the loaders' rules).

Weights are read from `model.safetensors` or `pytorch_model.bin` (`torch.load(weights_only=True)`); a copy of the
target's embedding (`embed_tokens.weight`) and rotary buffers are ignored: ours shares the target's.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import torch
from eagle.checkpoint import CheckpointError, read_weights, write_head_dir
from eagle.head_config import HeadConfig, eagle3_layers

IGNORED = ("embed_tokens.", "rotary_emb.")  # shared with the target, or recomputed


def is_published(raw: dict) -> bool:
    """A config.json in a published layout rather than ours (which always names its head_type)."""
    return "head_type" not in raw


def _read_weights(path: Path) -> dict[str, torch.Tensor]:
    if (path / "model.safetensors").exists():
        return read_weights(path)
    if (path / "pytorch_model.bin").exists():
        try:
            return torch.load(path / "pytorch_model.bin", map_location="cpu", weights_only=True)
        except Exception as e:  # pickles raise many types; name the file and the first line of why
            raise CheckpointError(f"draft head {str(path)!r}: pytorch_model.bin is not a plain tensor file "
                               f"({str(e).splitlines()[0]})") from None
    raise CheckpointError(f"draft head {str(path)!r}: no model.safetensors or pytorch_model.bin")


def _need(raw: dict, key: str, path: Path):
    if key not in raw:
        raise CheckpointError(f"draft head {str(path)!r}: config.json has no {key!r}")
    return raw[key]


def read_published(path, raw: dict, target=None) -> tuple[HeadConfig, dict[str, torch.Tensor]]:
    """(our config, weights under our names) of a head directory in a published layout, `raw` its config.json.
    `target` (a TargetModel) supplies EAGLE-3's default fused layers when the config names none."""
    path = Path(path)
    state = {k: v for k, v in _read_weights(path).items() if not any(s in k for s in IGNORED)}
    eagle3 = "LlamaForCausalLMEagle3" in (raw.get("architectures") or []) or any(
        k.startswith("midlayer.") for k in state)
    H, heads = _need(raw, "hidden_size", path), _need(raw, "num_attention_heads", path)
    scaling = raw.get("rope_scaling") or {}
    if scaling.get("rope_type", scaling.get("type", "default")) != "default":
        warnings.warn(f"draft head {str(path)!r}: rope_scaling {scaling} is not applied by the head (plain rope "
                      f"with theta {raw.get('rope_theta', 10000.0)}); drafts may be accepted less, output is the same")
    common = dict(hidden_size=H, vocab_size=_need(raw, "vocab_size", path), num_attention_heads=heads,
                  num_key_value_heads=raw.get("num_key_value_heads") or heads,
                  head_dim=raw.get("head_dim") or H // heads,
                  intermediate_size=_need(raw, "intermediate_size", path),
                  rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
                  rope_theta=float(raw.get("rope_theta", (raw.get("rope_parameters") or {}).get("rope_theta",
                                                                                              10000.0))))
    if not eagle3:
        cfg = HeadConfig(head_type="eagle1", fc_bias="fc.bias" in state,
                         num_layers=int(raw.get("num_hidden_layers", 1)), **common)
        return cfg, state
    ids = raw.get("eagle_aux_hidden_state_layer_ids")
    nested = (raw.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    if ids is None and nested is not None:  # layer outputs (SGLang, SpecForge): the next layer's input
        ids = [int(i) + 1 for i in nested]
    if ids is None:
        if target is None:
            raise CheckpointError(f"draft head {str(path)!r}: an EAGLE-3 config without "
                               "eagle_aux_hidden_state_layer_ids (top-level or in eagle_config); load it with its target to use the "
                               "default layers 2, L // 2, L - 3")
        ids = eagle3_layers(target.config.num_hidden_layers)
    ours = {}
    for k, v in state.items():
        if k.startswith("midlayer."):
            k = "layers.0." + k[len("midlayer."):]
        elif k == "lm_head.weight":
            k = "draft_head.weight"
        elif k == "d2t":
            v = v.long() + torch.arange(v.shape[0])
        elif k == "t2d":
            v = v.bool()
        ours[k] = v
    draft_vocab = ours["d2t"].shape[0] if "d2t" in ours else raw.get("draft_vocab_size") or common["vocab_size"]
    if "d2t" not in ours:  # no map: the draft vocabulary is the target's
        ours["d2t"] = torch.arange(draft_vocab)
        ours["t2d"] = torch.ones(common["vocab_size"], dtype=torch.bool)
    cfg = HeadConfig(head_type="eagle3", fc_bias=False, feature_layer_ids=list(ids),
                     draft_vocab_size=draft_vocab, **common)
    return cfg, ours


def export_published(head, out, engine: str = "vllm") -> list[str]:
    """Write `head` (an `eagle.head.EagleHead`) into directory `out` in the published layout of its kind
    (config.json + model.safetensors), whole or not at all; an `out` holding anything but a head is refused
    (`eagle.checkpoint.check_head_dir`). `engine` (vllm, sglang) picks what the two disagree on: an EAGLE-1 head's
    `architectures` (vLLM: LlamaForCausalLM; SGLang: LlamaForCausalLMEagle). Returns notes on what the layout
    cannot hold."""
    c, notes = head.config, []
    state = {k: (v.float() if v.is_floating_point() else v).detach().contiguous().cpu()
             for k, v in head.trainable_state_dict().items()}
    raw = {"model_type": "llama", "hidden_size": c.hidden_size, "intermediate_size": c.intermediate_size,
           "num_attention_heads": c.num_attention_heads, "num_key_value_heads": c.num_key_value_heads,
           "head_dim": c.head_dim, "rms_norm_eps": c.rms_norm_eps, "rope_theta": c.rope_theta,
           "vocab_size": c.vocab_size, "hidden_act": "silu", "tie_word_embeddings": False,
           "max_position_embeddings": 8192, "torch_dtype": "float32"}
    if c.head_type == "eagle3":
        out_state = {}
        for k, v in state.items():
            if k.startswith("layers.0."):
                k = "midlayer." + k[len("layers.0."):]
            elif k == "draft_head.weight":
                k = "lm_head.weight"
            elif k == "d2t":
                v = v - torch.arange(v.shape[0])
            out_state[k] = v
        out_state["d2t"], out_state["t2d"] = out_state["d2t"].long(), out_state["t2d"].bool()
        if any(i < 0 for i in c.feature_layer_ids):
            notes.append(f"feature_layer_ids {c.feature_layer_ids} count from the end; servers read them from the "
                         "start (index i of transformers' hidden_states is the input of layer i): edit "
                         "eagle_aux_hidden_state_layer_ids (and eagle_config's, one less)")
        raw.update(architectures=["LlamaForCausalLMEagle3"], num_hidden_layers=1,
                   draft_vocab_size=c.draft_vocab_size or c.vocab_size,
                   eagle_aux_hidden_state_layer_ids=list(c.feature_layer_ids),  # layer inputs: vLLM, llama.cpp
                   eagle_config={"eagle_aux_hidden_state_layer_ids": [i - 1 for i in c.feature_layer_ids],
                                 "use_aux_hidden_state": True})  # layer outputs: SGLang
        if not c.draft_vocab_size:  # vLLM has no place for a d2t when the vocabularies are the same
            del out_state["d2t"], out_state["t2d"]
    else:
        out_state = {k: v for k, v in state.items() if k != "d2t"}
        if c.draft_vocab_size:
            notes.append(f"the draft vocabulary ({c.draft_vocab_size} tokens) is left out: the EAGLE-1 layout has "
                         "none, so the exported head drafts over the whole vocabulary")
        if c.feature_layer_ids != [-1]:
            notes.append(f"feature_layer_ids {c.feature_layer_ids}: the EAGLE-1 layout reads the last features")
        arch = "LlamaForCausalLMEagle" if engine == "sglang" else "LlamaForCausalLM"
        raw.update(architectures=[arch], num_hidden_layers=c.num_layers, bias=c.fc_bias)
        if not c.fc_bias and engine == "sglang":  # SGLang's fc always has a bias: zeros keep the head's function
            out_state["fc.bias"] = torch.zeros(c.hidden_size)
    write_head_dir(out, raw, out_state)  # refuses an `out` that holds anything but a head
    return notes
