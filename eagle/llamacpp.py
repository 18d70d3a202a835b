"""An EAGLE-3 head as the draft GGUF llama.cpp runs (`--spec-type draft-eagle3`), written with the `gguf` package.

    export_llamacpp(head, "head.gguf", target_gguf="SmolLM2-135M-Instruct.Q4_1.gguf")

llama.cpp's EAGLE3 architecture (`src/models/eagle3.cpp`) is the EAGLE-3 layer our `Eagle3Head` computes: fc over
three target layers' inputs (`target_layers`, indexed like transformers' `hidden_states`, the layer inputs
llama.cpp extracts), norms on the token embedding (`attn_norm`) and the fused features (`attn_norm_2`), attention
over both, the draft lm_head (`output`) over the draft vocabulary and `d2t` as absolute target ids (int64). The token
embedding is the target's (llama.cpp reads it from the target's context), so the draft file holds none. What the
file holds, names and types, is what llama.cpp's own `convert_hf_to_gguf.py --target-model-dir` makes of our
published export (`eagle.interop.export_published`): 2-D weights in `outtype` (its default f16), norms in float32,
q and k rows permuted to llama.cpp's rotary layout, `t2d` left out. The tokenizer is copied from the target's GGUF
(llama.cpp checks that draft and target vocabularies agree), with the target's layer count and hidden size.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import torch

ARCH = "eagle3"
OUTTYPES = ("f16", "f32", "bf16")


class ExportError(ValueError):
    """A head, target or output file that cannot make a llama.cpp draft; the message says why in one line."""


def _permute(w: torch.Tensor, heads: int) -> torch.Tensor:
    """Rows of a q or k projection from transformers' rotary layout (halves) to llama.cpp's (interleaved pairs): per
    head, row j of the first half goes to 2j and row j of the second half to 2j + 1."""
    rows = w.shape[0]
    return w.reshape(heads, 2, rows // heads // 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def field_value(field):
    """(value, element type of an array or None) of a `gguf.GGUFReader` field: strings decoded, numbers as Python's."""
    import gguf

    kind = field.types[0]
    if kind == gguf.GGUFValueType.ARRAY:
        sub = field.types[-1]
        if sub == gguf.GGUFValueType.STRING:
            return [bytes(field.parts[i]).decode("utf-8", "surrogateescape") for i in field.data], sub
        return [field.parts[i].tolist()[0] for i in field.data], sub
    if kind == gguf.GGUFValueType.STRING:
        return bytes(field.parts[field.data[0]]).decode("utf-8", "surrogateescape"), None
    return field.parts[field.data[0]].tolist()[0], None


def _target_metadata(target_gguf: Path) -> tuple[dict, dict]:
    """(architecture facts, tokenizer fields) of the target's GGUF: its layer count, hidden size and vocabulary
    size, and every `tokenizer.*` field with its GGUF type."""
    import gguf

    try:
        reader = gguf.GGUFReader(target_gguf)
    except (OSError, ValueError) as e:
        raise ExportError(f"target GGUF {str(target_gguf)!r} cannot be read: {str(e).splitlines()[0]}") from None

    fields = {name: (field_value(f), f.types[0]) for name, f in reader.fields.items()}
    arch = fields.get("general.architecture", ((None, None), None))[0][0]
    facts = {"arch": arch}
    for key, name in (("block_count", "layers"), ("embedding_length", "hidden")):
        if f"{arch}.{key}" in fields:
            facts[name] = int(fields[f"{arch}.{key}"][0][0])
    tokens = fields.get("tokenizer.ggml.tokens")
    if tokens is None:
        raise ExportError(f"target GGUF {str(target_gguf)!r} holds no tokenizer (tokenizer.ggml.tokens): the draft "
                          "must carry the target's")
    facts["vocab"] = len(tokens[0][0])
    tokenizer = {k: v for k, v in fields.items() if k.startswith("tokenizer.")}
    return facts, tokenizer


def draft_tensors(head, outtype: str = "f16") -> dict[str, tuple[np.ndarray, str]]:
    """name -> (array, GGML type name) of the draft GGUF's tensors, in llama.cpp's names."""
    c = head.config
    state = {k: v.detach().float().cpu() for k, v in head.trainable_state_dict().items() if v.is_floating_point()}
    names = {"fc.weight": "fc.weight", "norm.weight": "output_norm.weight", "draft_head.weight": "output.weight",
             "layers.0.input_layernorm.weight": "blk.0.attn_norm.weight",
             "layers.0.hidden_norm.weight": "blk.0.attn_norm_2.weight",
             "layers.0.self_attn.q_proj.weight": "blk.0.attn_q.weight",
             "layers.0.self_attn.k_proj.weight": "blk.0.attn_k.weight",
             "layers.0.self_attn.v_proj.weight": "blk.0.attn_v.weight",
             "layers.0.self_attn.o_proj.weight": "blk.0.attn_output.weight",
             "layers.0.post_attention_layernorm.weight": "blk.0.ffn_norm.weight",
             "layers.0.mlp.gate_proj.weight": "blk.0.ffn_gate.weight",
             "layers.0.mlp.up_proj.weight": "blk.0.ffn_up.weight",
             "layers.0.mlp.down_proj.weight": "blk.0.ffn_down.weight"}
    extra = sorted(set(state) - set(names))
    if extra:
        raise ExportError(f"head weights {', '.join(extra)}: llama.cpp's EAGLE3 draft has no place for them")
    wide = {"f16": np.float16, "f32": np.float32, "bf16": None}[outtype]
    out = {}
    for ours, name in names.items():
        w = state[ours]
        if name == "blk.0.attn_q.weight":
            w = _permute(w, c.num_attention_heads)
        elif name == "blk.0.attn_k.weight":
            w = _permute(w, c.num_key_value_heads)
        if w.dim() <= 1 or name.endswith("_norm.weight") or name.endswith("norm_2.weight"):
            out[name] = (w.numpy().astype(np.float32), "F32")
        elif wide is None:  # bfloat16: its 16 bits, as the converter writes them
            out[name] = (w.to(torch.bfloat16).view(torch.int16).numpy(), "BF16")
        else:
            out[name] = (w.numpy().astype(wide), outtype.upper())
    if c.draft_vocab_size:
        out["d2t"] = (head.d2t.detach().cpu().numpy().astype(np.int64), "I64")
    return out


def export_llamacpp(head, out, target_gguf, outtype: str = "f16", context_length: int | None = None) -> list[str]:
    """Write `head` (an `Eagle3Head`) to the file `out` as llama.cpp's EAGLE3 draft, whole or not at all (a temporary
    sibling renamed in); `target_gguf` is the target's GGUF, whose tokenizer and shape the draft must share. Returns
    notes on what the file does not hold."""
    import gguf

    c, out, target_gguf = head.config, Path(out), Path(target_gguf)
    check(c, out, outtype)
    facts, tokenizer = _target_metadata(target_gguf)
    if facts["vocab"] != c.vocab_size:
        raise ExportError(f"target GGUF {str(target_gguf)!r} has {facts['vocab']} tokens but the head was made for a "
                          f"vocabulary of {c.vocab_size}: name the GGUF of the head's target ({c.target!r})")
    layers = facts.get("layers")
    bad = [i for i in c.feature_layer_ids if layers is not None and not 0 <= i < layers]
    if bad:
        raise ExportError(f"feature_layer_ids {c.feature_layer_ids}: llama.cpp extracts the inputs of target layers "
                          f"0..{layers - 1}")
    notes = ["t2d is left out (llama.cpp does not read it); the token embedding is the target's"]
    if str(facts["arch"]).startswith("gemma"):  # checked in llama.cpp 0c1e570: src/models/gemma3.cpp
        notes.append(f"llama.cpp 0c1e570's {facts['arch']} graph does not record its layer inputs, so decoding with "
                     "this draft stops at GGML_ASSERT (llama-graph.cpp:1384, 'layer input tensor is null'); its "
                     "llama and qwen3 graphs do")
    w = gguf.GGUFWriter(None, ARCH)
    w.add_name(f"EAGLE-3 draft for {c.target or target_gguf.stem}")
    w.add_file_type({"f32": 0, "f16": 1, "bf16": 32}[outtype])
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    w.add_uint32(f"{ARCH}.vocab_size", c.vocab_size)
    w.add_uint32(f"{ARCH}.context_length", context_length or 8192)
    w.add_uint32(f"{ARCH}.embedding_length", c.hidden_size)
    w.add_uint32(f"{ARCH}.block_count", 1)
    w.add_uint32(f"{ARCH}.feed_forward_length", c.intermediate_size)
    w.add_uint32(f"{ARCH}.attention.head_count", c.num_attention_heads)
    w.add_uint32(f"{ARCH}.attention.head_count_kv", c.num_key_value_heads)
    w.add_uint32(f"{ARCH}.attention.key_length", c.head_dim)
    w.add_uint32(f"{ARCH}.attention.value_length", c.head_dim)
    w.add_float32(f"{ARCH}.rope.freq_base", c.rope_theta)
    w.add_float32(f"{ARCH}.attention.layer_norm_rms_epsilon", c.rms_norm_eps)
    w.add_uint32(f"{ARCH}.rope.dimension_count", c.head_dim)
    w.add_array(f"{ARCH}.target_layers", [int(i) for i in c.feature_layer_ids])
    w.add_uint32(f"{ARCH}.target_hidden_size", facts.get("hidden", c.hidden_size))
    w.add_bool(f"{ARCH}.norm_before_residual", False)
    w.add_bool(f"{ARCH}.norm_before_fc", False)
    for key, ((val, sub), kind) in tokenizer.items():
        w.add_key_value(key, val, kind, sub_type=sub)
    for name, (arr, kind) in draft_tensors(head, outtype).items():
        w.add_tensor(name, arr, raw_dtype=getattr(gguf.GGMLQuantizationType, kind))
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    try:
        w.write_header_to_file(tmp)
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, out)
    finally:
        if tmp.exists():
            tmp.unlink()
    return notes


def check(c, out: Path, outtype: str) -> None:
    """One-line ExportErrors before anything is read or written."""
    if c.head_type != "eagle3":
        raise ExportError(f"head_type {c.head_type}: llama.cpp has no EAGLE-1/2 draft type (its drafts are "
                          "draft-eagle3, a draft model, or n-grams); train an EAGLE-3 head "
                          "(configs/smollm2-135m-eagle3.yaml) for llama.cpp, or export this one for vLLM / SGLang")
    if len(c.feature_layer_ids) != 3:
        raise ExportError(f"feature_layer_ids {c.feature_layer_ids}: llama.cpp's EAGLE3 draft fuses exactly 3 target "
                          "layers")
    variant = [k for k in ("fc_norm", "norm_output") if getattr(c, k, False)]
    if variant:
        raise ExportError(f"{' and '.join(variant)} (EAGLE-3.1): llama.cpp 0c1e570's EAGLE3 draft has neither; export "
                          "this head for vLLM (--format speculators) or train an EAGLE-3 head without them")
    if outtype not in OUTTYPES:
        raise ExportError(f"--outtype {outtype!r}: expected one of {', '.join(OUTTYPES)}")
    if out.suffix != ".gguf":
        raise ExportError(f"--out {str(out)!r}: name a .gguf file for llama.cpp")
    if out.exists() and not is_draft_gguf(out):
        raise ExportError(f"--out {str(out)!r} exists and is not an EAGLE3 draft GGUF: it is never replaced; name "
                          "a new file")


def is_draft_gguf(path: Path) -> bool:
    """A file a previous export wrote (an EAGLE3 GGUF), which a new export may replace."""
    try:
        with open(path, "rb") as f:
            head = f.read(1 << 16)
    except OSError:
        return False
    return head[:4] == b"GGUF" and b"general.architecture" in head and ARCH.encode() in head
