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

    def read(self, names: list[str], device: torch.device | str = "cpu",
             dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
        """The tensors `names`, each read alone from its file and moved to `device` / `dtype`."""
        from safetensors import safe_open

        missing = [n for n in names if n not in self.where]
        if missing:
            raise WeightsError(f"checkpoint {str(self.folder)!r} holds no tensor {missing[0]!r}")
        out = {}
        for f in dict.fromkeys(self.where[n] for n in names):
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
        gives the same answer whether the model is then loaded whole or without its layers."""
        h = hashlib.sha256()
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
    """The causal LM of `config` with every parameter outside its decoder layers read from `files` onto `device`
    (embedding, final norm, lm_head: tied to the embedding where the config ties them), the layers left on the
    `meta` device. WeightsError when the files do not name a parameter as the model does."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation=attn_implementation)
    in_layers = {id(p) for p in model.get_decoder().layers.parameters()}
    names = [n for n, p in model.named_parameters() if id(p) not in in_layers]
    out_emb, in_emb = model.get_output_embeddings(), model.get_input_embeddings()
    tied = out_emb is not None and out_emb.weight is in_emb.weight
    tensors = files.read(names, device, dtype)
    for name, t in tensors.items():
        module, _, attr = name.rpartition(".")
        setattr(model.get_submodule(module), attr, nn.Parameter(t, requires_grad=False))
    if tied:
        out_emb.weight = in_emb.weight
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
