"""The target's KV cache with three verbs: `append` (a forward pass does it), `crop(n)` and `compact(start, keep)`.

Every detail of transformers' cache classes lives here and in `eagle.target.preallocated_cache`, because those
internals change between releases. The cache is a `DynamicCache` built without the model config, so every layer
keeps all positions (no sliding-window eviction); positions are then plain indices along the sequence axis. Its
layers write new keys and values into a buffer that grows by doubling (gpt-fast style) instead of concatenating
(a copy of the whole cache per layer per step). crop only moves the length; compact moves just the accepted
rows that are not in place yet, with torch's indexing or a faster `move` given by the caller (the CPU backend's
`compact_kv`: every layer's in one C call).
"""

from __future__ import annotations

import torch

from collections.abc import Callable

from eagle.target import PreallocatedLayer, preallocated_cache


class TargetCache:
    def __init__(self, preallocate: bool = True, move: Callable | None = None):
        """`move(layers, start, keep) -> bool`: moves every layer's rows start + keep down to start, start + 1, ...
        where it can (returning False where it cannot), instead of torch's indexing."""
        self.hf = preallocated_cache(preallocate)
        self.move = move

    def reserve(self, target, n: int) -> None:
        """Every layer with buffers for n positions now, before the first pass (which transformers' cache would
        otherwise make in its own path): then the kernels' all-layer call can take that pass too. A cache made
        without preallocation is left as it is."""
        if self.hf.layer_class_to_replicate is not PreallocatedLayer:
            return
        kv_heads, head_dim = target.kv_heads_and_dim
        like = torch.empty(1, kv_heads, 0, head_dim, dtype=target.dtype, device=target.device)
        while len(self.hf.layers) < target.config.num_hidden_layers:
            self.hf.layers.append(PreallocatedLayer())
        for layer in self.hf.layers:
            if type(layer) is PreallocatedLayer:
                layer.reserve(like, n)

    def __len__(self) -> int:
        return self.hf.get_seq_length()

    def _layers(self):
        return [layer for layer in self.hf.layers if layer.get_seq_length()]

    def crop(self, n: int) -> None:
        """Keep the first n positions."""
        for layer in self.hf.layers:
            if type(layer) is PreallocatedLayer and layer._k is not None:
                if layer.length > n:  # the buffers stay; only the length moves
                    layer.length = n
            elif layer.get_seq_length():
                layer.keys = layer.keys[..., :n, :]
                layer.values = layer.values[..., :n, :]

    def compact(self, start: int, keep: torch.Tensor) -> None:
        """Keep positions [0, start) plus start + keep (sorted offsets), moved down to start, start + 1, ...

        After a verification pass over N tree nodes appended at `start`, `keep` is the accepted path.
        """
        m = keep.shape[0]
        contiguous = bool(keep[-1].item() == m - 1)  # a chain's accepted path is a prefix: nothing to move
        if not contiguous and not (self.move is not None and self.move(self.hf.layers, start, keep)):
            for layer in self._layers():
                keys, values = layer.keys, layer.values
                src = start + keep.to(keys.device)
                keys[..., start:start + m, :] = keys.index_select(-2, src)
                values[..., start:start + m, :] = values.index_select(-2, src)
        self.crop(start + m)
