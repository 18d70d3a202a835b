"""A target checkpoint's weight files, read a tensor at a time: what offline training needs of a 70B target is its
embedding, final norm and lm_head (a few GB), not its 140 GB of decoder layers.

    files = WeightFiles.of(folder)                   # None unless the folder holds safetensors weights
    files.read(["model.norm.weight"])                # {name: tensor}, mapped from its file alone
    model = model_without_layers(folder, files, config, dtype, device)  # layers on the meta device
    files.identity()                                 # a content hash of the files (headers + sampled bytes)

A model built on the `meta` device from its config has every parameter's name and shape and no memory; the ones
outside the decoder layers are then read from the files (safetensors maps each tensor alone) and put in place. The
layers stay on `meta`, so anything that runs them (a forward pass) fails loudly instead of computing with garbage.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

SAMPLE_BLOCKS = 16  # 4 KiB blocks read from each weight file, evenly spaced, for its identity


class WeightsError(ValueError):
    """A checkpoint whose tensors cannot be read one by one; the message says which and why."""


@dataclass
class WeightFiles:
    folder: Path
    where: dict[str, Path]  # tensor name -> the safetensors file holding it
    # a hub checkpoint's files are fetched as they are read (`of_hub`): a 70B target's three end tensors without
    # its 140 GB of layers
    fetch: Callable[[str], Path] | None = None

    @classmethod
    def of(cls, folder: str | Path) -> "WeightFiles | None":
        """The safetensors weights of a checkpoint directory (one file, or shards with an index), or None."""
        folder = Path(folder)
        index = folder / "model.safetensors.index.json"
        if index.exists():
            weight_map = json.loads(index.read_text())["weight_map"]
            return cls(folder, {name: folder / f for name, f in weight_map.items()})
        files = sorted(folder.glob("*.safetensors"))
        if not files:
            return None
        from safetensors import safe_open

        where = {}
        for f in files:
            with safe_open(f, "pt") as handle:
                where.update({name: f for name in handle.keys()})
        return cls(folder, where)

    @classmethod
    def of_hub(cls, repo: str) -> "WeightFiles | None":
        """A hub checkpoint's weights by its index, its shard files fetched (into the hub's cache) only as `read`
        needs them; None when it has no safetensors weights. The hub's errors are OSErrors."""
        from huggingface_hub import hf_hub_download
        from huggingface_hub.errors import EntryNotFoundError

        try:
            index = Path(hf_hub_download(repo, "model.safetensors.index.json"))
        except EntryNotFoundError:
            try:
                return cls.of(Path(hf_hub_download(repo, "model.safetensors")).parent)
            except EntryNotFoundError:
                return None
        weight_map = json.loads(index.read_text())["weight_map"]
        return cls(index.parent, {name: index.parent / f for name, f in weight_map.items()},
                   lambda f: Path(hf_hub_download(repo, f)))

    @property
    def revision(self) -> str | None:
        """The commit of a hub snapshot (`.../snapshots/COMMIT/`: its files never change), else None."""
        return self.folder.name if self.folder.parent.name == "snapshots" else None

    def key_of(self, name: str) -> str | None:
        """The files' name of a model's parameter `name`: itself, or the one key that ends in its longest trailing
        part (checkpoints of wrapped models name `model.language_model.embed_tokens.weight` otherwise:
        `language_model.model.embed_tokens.weight`), or None."""
        if name in self.where:
            return name
        parts = name.split(".")
        for i in range(len(parts) - 1):  # (the last part alone, "weight", names nothing)
            tail = "." + ".".join(parts[i:])
            hits = [k for k in self.where if k.endswith(tail)]
            if len(hits) == 1:
                return hits[0]
            if len(hits) > 1:
                return None
        return None

    def read(self, names: list[str], device: torch.device | str = "cpu",
             dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
        """The tensors `names`, each read alone from its file and moved to `device` / `dtype`."""
        from safetensors import safe_open

        missing = [n for n in names if n not in self.where]
        if missing:
            raise WeightsError(f"checkpoint {str(self.folder)!r} holds no tensor {missing[0]!r}")
        out = {}
        for f in dict.fromkeys(self.where[n] for n in names):
            if not f.exists() and self.fetch is not None:
                self.fetch(f.name)
            with safe_open(f, "pt") as handle:
                for n in names:
                    if self.where[n] == f:
                        t = handle.get_tensor(n)
                        out[n] = t.to(device=device, dtype=dtype if dtype is not None and t.is_floating_point()
                                      else t.dtype)
        return out

    def identity(self) -> str:
        """A hash of every weight file's name, size, safetensors header and `SAMPLE_BLOCKS` blocks of its bytes:
        a fine-tune of the same base differs in nearly every byte, so it hashes otherwise, and reading a few MB
        gives the same answer whether the model is then loaded whole or without its layers. A hub snapshot is
        named by its repository and commit instead (its files may not all be here)."""
        h = hashlib.sha256()
        if self.revision is not None:
            h.update(f"hub|{self.folder.parent.parent.name}|{self.revision}".encode())
            return h.hexdigest()[:16]
        for f in sorted(set(self.where.values())):
            size = f.stat().st_size
            h.update(f"{f.name}|{size}|".encode())
            with open(f, "rb") as handle:
                n = int.from_bytes(handle.read(8), "little")
                h.update(handle.read(min(n, 100 << 20)))
                for b in range(SAMPLE_BLOCKS):
                    handle.seek((size - 4096) * b // max(1, SAMPLE_BLOCKS - 1) if size > 4096 else 0)
                    h.update(handle.read(4096))
        return h.hexdigest()[:16]


def layers_prefix(model: nn.Module) -> str:
    """The name of the decoder-layer list inside `model` (`model.layers` for a Llama), as the files name it."""
    layers = model.get_decoder().layers
    return next(n for n, m in model.named_modules() if m is layers)


def model_without_layers(files: WeightFiles, config, dtype: torch.dtype, device: torch.device,
                         attn_implementation: str = "sdpa") -> nn.Module:
    """The causal LM of `config` with its embedding, final norm and lm_head (tied to the embedding where the config
    ties them) read from `files` onto `device`, and every other parameter (the decoder layers, a vision tower) left
    on the `meta` device. WeightsError when the files do not hold those three as the model names them."""
    from accelerate import init_empty_weights
    from transformers import AutoModelForCausalLM

    # parameters on the meta device; buffers made as the modules make them (Gemma's embedding scale, rotary
    # frequencies), with their values
    with init_empty_weights(include_buffers=False):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation=attn_implementation)
    decoder = model.get_decoder()
    norm = next((getattr(decoder, a) for a in ("norm", "final_layernorm") if hasattr(decoder, a)), None)
    if not hasattr(decoder, "layers") or norm is None:
        raise WeightsError(f"{type(model).__name__}'s decoder keeps no `layers` list and final norm")
    ends = [model.get_input_embeddings(), norm, model.get_output_embeddings()]
    names = {id(p): n for n, p in model.named_parameters()}
    wanted = {names[id(p)]: files.key_of(names[id(p)]) for m in ends for p in m.parameters(recurse=False)}
    # a tied lm_head is not in the files: transformers ties it to the embedding below, as from_pretrained does
    found = {n: k for n, k in wanted.items() if k is not None}
    tensors = files.read(list(found.values()), device, dtype)
    for name, key in found.items():
        module, _, attr = name.rpartition(".")
        setattr(model.get_submodule(module), attr, nn.Parameter(tensors[key], requires_grad=False))
    model.tie_weights()
    for m in ends:
        for attr, buf in list(m._buffers.items()):
            if buf is not None:
                m.register_buffer(attr, buf.to(device), persistent=attr not in m._non_persistent_buffers_set)
    left = [n for m in ends for n, t in [*m.named_parameters(), *m.named_buffers()] if t.is_meta]
    if left:
        raise WeightsError(f"{type(model).__name__}: the checkpoint holds no {left[0]!r} as the model names it")
    return model.eval()


def layer_weights(files: WeightFiles, model: nn.Module, index: int, dtype: torch.dtype,
                  device: torch.device) -> dict[str, torch.Tensor]:
    """Decoder layer `index`'s state dict (names inside the layer), read from `files` alone."""
    n = len(model.get_decoder().layers)
    prefix = f"{layers_prefix(model)}.{index % n}."
    names = [k for k in files.where if k.startswith(prefix)]
    if not names:
        raise WeightsError(f"checkpoint {str(files.folder)!r} holds no tensor of {prefix.rstrip('.')}")
    return {k.removeprefix(prefix): v for k, v in files.read(names, device, dtype).items()}
