"""Heads in the published EAGLE layouts: read them as ours, and write ours in them (what vLLM and SGLang load).

- EAGLE-1/2 (`yuhuili/EAGLE-*`): a Llama-style `config.json` (`hidden_size`, `num_attention_heads`, ...,
  `num_hidden_layers`) and `fc.*`, `layers.N.*` weights, layer 0 without an input norm. Our key names are the
  same. The EAGLE repo's `bias` key (its fc bias) is never written: vLLM reads `bias` as the attention bias and
  builds q/k/v/o biases that nothing fills (`eagle.contracts`, rule vllm.config_bias); whether a head has an fc
  bias is read from its weights.
- EAGLE-3 (`architectures: ["LlamaForCausalLMEagle3"]`): `fc.weight` (3H -> H), `midlayer.*` (our `layers.0.*`),
  `norm.weight`, `lm_head.weight` over the draft vocabulary (our `draft_head.weight`), `d2t` as offsets (target id
  = draft index + d2t[index]; ours holds the target ids), `t2d` a boolean mask over the target vocabulary. The fused
  layers: a top-level `eagle_aux_hidden_state_layer_ids` is indexed like transformers' `hidden_states` tuple (a
  layer's input, as vLLM and llama.cpp read it, and as ours are); `eagle_config.eagle_aux_hidden_state_layer_ids`
  names layer outputs (SGLang and SpecForge: index + 1). Export writes both; reading prefers the top-level key.
  Without either, EAGLE-3's default 2, L // 2, L - 3 of the target (eagle.contracts has the loaders' rules).

An export is checked against the named engine's loader rules (`eagle.contracts`) before anything is written: one
that the engine would load with weights dropped, renamed or left uninitialized, or that cannot hold what the head
computes (fused layers other than the ones it was trained on), raises ExportError in one line naming what and how
to fix it, unless `allow_lossy` (the CLI's `--allow-lossy`) asks for it anyway. A reduced EAGLE-1 draft vocabulary
is a note, not a loss: no weight is dropped, the exported head drafts over the target's whole lm_head.

`export_speculators` writes the speculators library's format (`speculators_model_type`, `transformer_layer_config`,
`speculators_config`), which vLLM loads as a speculator model on its own (`vllm serve DIR`, or
`speculative_config={"model": DIR}`): EAGLE-3 heads only, as vLLM 0.32.0 registers no other EAGLE speculator type.

Weights are read from `model.safetensors` or `pytorch_model.bin` (`torch.load(weights_only=True)`); a copy of the
target's embedding (`embed_tokens.weight`) and rotary buffers are ignored: ours shares the target's.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import torch
from eagle.checkpoint import CheckpointError, read_weights, write_head_dir
from eagle.head_config import HeadConfig, eagle3_layers
from eagle.speculators import flatten_speculators, is_speculators

IGNORED = ("embed_tokens.", "rotary_emb.")  # shared with the target, or recomputed
# what drafting over the whole vocabulary instead of the head's draft vocabulary did in vLLM (benchmarks/vllm_check.py)
DRAFT_VOCAB_MEASURED = ("measured in vLLM 0.32.0 on a 14-minute SmolLM2 head of 4,096 draft tokens: tau 1.53 "
                        "against our 1.52, 16 MT-bench prompts")


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
    if is_speculators(raw):
        raw = flatten_speculators(raw, path)
    for key, what in (("norm_before_residual", "a normed residual"), ("norm_before_fc", "one norm before fc")):
        if raw.get(key):
            raise CheckpointError(f"draft head {str(path)!r}: {key} true ({what}) is not computed by this "
                                  "project's EAGLE-3 head")
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
                     draft_vocab_size=draft_vocab, fc_norm=bool(raw.get("fc_norm")),
                     norm_output=bool(raw.get("norm_output")), **common)
    return cfg, ours


class ExportError(ValueError):
    """An export the engine would load with a loss, refused before anything is written."""


def _float32_state(head) -> dict[str, torch.Tensor]:
    """The head's weights as the published layouts hold them: float32 (maps stay integer), on the CPU."""
    return {k: (v.float() if v.is_floating_point() else v).detach().contiguous().cpu()
            for k, v in head.trainable_state_dict().items()}


def _common_raw(c: HeadConfig) -> dict:
    """The Llama-style config keys every layout shares (each one's meaning in vLLM and SGLang is the Llama
    config's; `eagle.contracts` has a rule for the keys that change what they build)."""
    return {"model_type": "llama", "hidden_size": c.hidden_size, "intermediate_size": c.intermediate_size,
            "num_attention_heads": c.num_attention_heads, "num_key_value_heads": c.num_key_value_heads,
            "head_dim": c.head_dim, "rms_norm_eps": c.rms_norm_eps, "rope_theta": c.rope_theta,
            "vocab_size": c.vocab_size, "hidden_act": "silu", "tie_word_embeddings": False,
            "max_position_embeddings": 8192, "torch_dtype": "float32"}


def _eagle3_state(state: dict[str, torch.Tensor], c: HeadConfig, layer_prefix: str) -> dict[str, torch.Tensor]:
    out = {}
    for k, v in state.items():
        if k.startswith("layers.0."):
            k = layer_prefix + k[len("layers.0."):]
        elif k == "draft_head.weight":
            k = "lm_head.weight"
        elif k == "d2t":
            v = v - torch.arange(v.shape[0])
        out[k] = v
    out["d2t"], out["t2d"] = out["d2t"].long(), out["t2d"].bool()
    if not c.draft_vocab_size:  # vLLM has no place for a d2t when the vocabularies are the same
        del out["d2t"], out["t2d"]
    return out


def _eagle3_keys(c: HeadConfig) -> dict:
    return {"draft_vocab_size": c.draft_vocab_size or c.vocab_size,
            "eagle_aux_hidden_state_layer_ids": list(c.feature_layer_ids),  # layer inputs: vLLM, llama.cpp
            # the residual is the raw fused feature, as EAGLE-3's; vLLM's speculators config defaults it to true
            "norm_before_residual": False,
            **({"fc_norm": True} if c.fc_norm else {}), **({"norm_output": True} if c.norm_output else {})}


def _refuse_or_note(losses: list[str], engine: str, allow_lossy: bool) -> list[str]:
    if losses and not allow_lossy:
        raise ExportError(f"{engine} would not run this head as trained: {'; '.join(losses)} "
                          "(pass --allow-lossy to write it anyway)")
    return losses


def _contract_losses(raw: dict, state: dict[str, torch.Tensor], kind: str, engine: str) -> list[str]:
    from eagle.contracts import Head, broken_rules

    tensors = {k: (tuple(v.shape), str(v.dtype).removeprefix("torch.")) for k, v in state.items()}
    return broken_rules(Head(Path("."), kind, raw, tensors), engine)


def export_published(head, out, engine: str = "vllm", allow_lossy: bool = False) -> list[str]:
    """Write `head` (an `eagle.head.EagleHead`) into directory `out` in the published layout of its kind
    (config.json + model.safetensors), whole or not at all; an `out` holding anything but a head is refused
    (`eagle.checkpoint.check_head_dir`). `engine` (vllm, sglang) picks what the two disagree on: an EAGLE-1 head's
    `architectures` (vLLM: LlamaForCausalLM; SGLang: LlamaForCausalLMEagle) and its fc bias. An export the engine
    would run differently from the head raises ExportError unless `allow_lossy`; returns notes (what an engine
    does differently without losing a weight, and with `allow_lossy` what was lost)."""
    c, losses, notes = head.config, [], []
    state = _float32_state(head)
    raw = _common_raw(c)
    if c.head_type == "eagle3":
        out_state = _eagle3_state(state, c, "midlayer.")
        if any(i < 0 for i in c.feature_layer_ids):
            losses.append(f"feature_layer_ids {c.feature_layer_ids} count from the end and servers read them from "
                          "the start: train with feature_layer_ids from the start (index i of transformers' "
                          "hidden_states is the input of layer i)")
        if engine == "sglang" and (c.fc_norm or c.norm_output):
            losses.append("fc_norm / norm_output (EAGLE-3.1): SGLang's llama_eagle3.py (sgl-project/sglang 03d5a77) "
                          "builds neither and skips weights it has no parameter for: export it for vLLM")
        raw.update(architectures=["LlamaForCausalLMEagle3"], num_hidden_layers=1, **_eagle3_keys(c),
                   eagle_config={"eagle_aux_hidden_state_layer_ids": [i - 1 for i in c.feature_layer_ids],
                                 "use_aux_hidden_state": True})  # layer outputs: SGLang
    else:
        out_state = {k: v for k, v in state.items() if k != "d2t"}
        if c.draft_vocab_size:  # no weight lost: the head reads the target's lm_head, all of it instead of rows
            notes.append(f"the reduced draft vocabulary ({c.draft_vocab_size} tokens) has no place in the EAGLE-1 "
                         f"layout: the exported head drafts over the whole vocabulary ({DRAFT_VOCAB_MEASURED})")
        if c.feature_layer_ids != [-1]:
            losses.append(f"feature_layer_ids {c.feature_layer_ids}: the EAGLE-1 layout reads the last layer's "
                          "features: train with feature_layer_ids [-1]")
        arch = "LlamaForCausalLMEagle" if engine == "sglang" else "LlamaForCausalLM"
        raw.update(architectures=[arch], num_hidden_layers=c.num_layers)
        if not c.fc_bias and engine == "sglang":  # SGLang's fc always has a bias: zeros keep the head's function
            out_state["fc.bias"] = torch.zeros(c.hidden_size)
    losses += _contract_losses(raw, out_state, c.head_type, engine)
    notes += _refuse_or_note(losses, engine, allow_lossy)
    write_head_dir(out, raw, out_state)  # refuses an `out` that holds anything but a head
    return notes


def export_speculators(head, out, allow_lossy: bool = False, verifier: str = "", num_speculative_tokens: int = 3
                       ) -> list[str]:
    """Write an EAGLE-3 `head` into directory `out` in the speculators format (config.json with
    `speculators_model_type: eagle3`, the draft layer's Llama config under `transformer_layer_config`, the method
    and the verifier under `speculators_config`; weights as in the published layout, the layer as `layers.0.*`), which
    vLLM loads as a speculator model by itself. `verifier`: the target's name or path as vLLM should load it (the
    head's own target name by default); `num_speculative_tokens`: the proposal's default K."""
    c = head.config
    if c.head_type != "eagle3":
        raise ExportError(f"the speculators format holds EAGLE-3 heads for vLLM (0.32.0 registers eagle3, peagle and "
                          f"dflash speculators, no EAGLE-1): export this {c.head_type} head with --format hf")
    losses = []
    if any(i < 0 for i in c.feature_layer_ids):
        losses.append(f"feature_layer_ids {c.feature_layer_ids} count from the end and servers read them from the "
                      "start: train with feature_layer_ids from the start")
    out_state = _eagle3_state(_float32_state(head), c, "layers.0.")
    layer = {**_common_raw(c), "architectures": ["LlamaForCausalLM"], "num_hidden_layers": 1}
    raw = {"architectures": ["Eagle3Speculator"], "speculators_model_type": "eagle3",
           "speculators_version": "0.3.0", "transformer_layer_config": layer, **_eagle3_keys(c),
           "target_hidden_size": c.hidden_size, "torch_dtype": "float32",
           "speculators_config": {"algorithm": "eagle3", "default_proposal_method": "greedy",
                                  "proposal_methods": [{"proposal_type": "greedy",
                                                        "speculative_tokens": num_speculative_tokens}],
                                  "verifier": {"name_or_path": verifier or c.target,
                                               "architectures": ["LlamaForCausalLM"]}}}
    flat = {**layer, **_eagle3_keys(c), "architectures": ["LlamaForCausalLMEagle3"]}  # what vLLM builds of it
    losses += _contract_losses(flat, {k.replace("layers.0.", "midlayer.", 1): v for k, v in out_state.items()},
                               "eagle3", "vllm")
    notes = _refuse_or_note(losses, "vllm", allow_lossy)
    write_head_dir(out, raw, out_state)
    return notes
