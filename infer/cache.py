"""The target's KV cache with three verbs: `append` (a forward pass does it), `crop(n)` and `compact(start, keep)`.

Every detail of transformers' cache classes lives here, because those internals change between releases. We
use a `DynamicCache` built without the model config, so every layer keeps all positions (no sliding-window
eviction); positions are then plain indices along the sequence axis. Its layers are preallocated (gpt-fast
style): `update` writes new keys and values into a buffer that grows by doubling, instead of concatenating
(a copy of the whole cache per layer per step), and crop / compact only move the length.
"""

from __future__ import annotations

import math

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer


class PreallocatedLayer(DynamicLayer):
    """A DynamicLayer whose keys / values are views of a preallocated buffer; `update` writes in place."""

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        super().lazy_initialization(key_states, value_states)
        self._k = self._v = None

    def update(self, key_states, value_states, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        n = self.keys.shape[-2] if self.keys.dim() == 4 else 0
        end = n + key_states.shape[-2]
        if self._k is None or self._k.shape[-2] < end or self._k.shape[:2] != key_states.shape[:2]:
            cap = max(256, 1 << math.ceil(math.log2(end)))
            k = key_states.new_empty(*key_states.shape[:2], cap, key_states.shape[-1])
            v = value_states.new_empty(*value_states.shape[:2], cap, value_states.shape[-1])
            if n:
                k[..., :n, :], v[..., :n, :] = self.keys, self.values
            self._k, self._v = k, v
        self._k[..., n:end, :] = key_states
        self._v[..., n:end, :] = value_states
        self.keys, self.values = self._k[..., :end, :], self._v[..., :end, :]
        return self.keys, self.values


class TargetCache:
    def __init__(self, preallocate: bool = True):
        self.hf = DynamicCache()
        if preallocate:
            self.hf.layer_class_to_replicate = PreallocatedLayer

    def __len__(self) -> int:
        return self.hf.get_seq_length()

    def _layers(self):
        return [layer for layer in self.hf.layers if getattr(layer, "keys", None) is not None and layer.keys.numel()]

    def crop(self, n: int) -> None:
        """Keep the first n positions."""
        for layer in self._layers():
            layer.keys = layer.keys[..., :n, :]
            layer.values = layer.values[..., :n, :]

    def compact(self, start: int, keep: torch.Tensor) -> None:
        """Keep positions [0, start) plus start + keep (sorted offsets), moved down to start, start + 1, ...

        After a verification pass over N tree nodes appended at `start`, `keep` is the accepted path.
        """
        m = keep.shape[0]
        contiguous = bool(keep[-1].item() == m - 1)  # a chain's accepted path is a prefix: nothing to move
        for layer in self._layers():
            if not contiguous:
                src = start + keep.to(layer.keys.device)
                layer.keys[..., start:start + m, :] = layer.keys.index_select(-2, src)
                layer.values[..., start:start + m, :] = layer.values.index_select(-2, src)
            layer.keys = layer.keys[..., :start + m, :]
            layer.values = layer.values[..., :start + m, :]
