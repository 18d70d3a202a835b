"""The backend's fused modules: `KernelAttention` (a Llama-style attention module, in one C call with a
preallocated cache), `FusedLayer` (a whole decoder layer in one C call) and `FusedStack` (every layer of a base
model in one C call), each given to a module only after a check on random inputs that it computes what the stock
forward computes (`patch`).
"""

from __future__ import annotations

import copy
import inspect
import math
import weakref
from dataclasses import dataclass, field

import torch
from torch import nn

from transformers import DynamicCache
from transformers.modeling_outputs import BaseModelOutputWithPast
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from cpu_backend import kernels, switches, weight_layouts
from cpu_backend.attention import SWITCHED_FROM as ATTENTION_NAMES
from cpu_backend.attention import MAX_ROWS as ATTENTION_ROWS
from cpu_backend.modules import BackendModule, row_spans
from cpu_backend.parts import (KernelMLP, KernelNorm, PackedLinear, norm_weight, row_index, stock_modules_on_cpu,
                               stock_path, wants_grad)
from cpu_backend.plan import MAX_ROWS, apply
from eagle.target import PreallocatedLayer, preallocated_cache

def _attention_kernel(self: nn.Module, x: torch.Tensor, position_embeddings, mask, cache, attend, kwargs: dict):
    """An attention module's forward (transformers' Llama-style: q / k / v projections, rotary embedding, cache
    update, the attention function, o projection) with the products in their measured layouts and the rotary
    embedding in one C call per tensor: the same numbers as the stock forward, in about a third of its torch
    operations."""
    b, m, d = x.shape[0], x.shape[1], self.head_dim
    cos, sin = position_embeddings
    rows = row_index(x)
    q = apply(x, self.q_proj.weight, self.q_proj.bias, self.q_proj.cpu_plan.by_rows[rows])
    k = apply(x, self.k_proj.weight, self.k_proj.bias, self.k_proj.cpu_plan.by_rows[rows])
    if "q_norm" in self._modules:  # Qwen3's, Gemma-3's: each head's query and key normed before the rotation
        q, k = self.q_norm(q.view(b, m, -1, d)).view(b, m, -1), self.k_norm(k.view(b, m, -1, d)).view(b, m, -1)
    q, k = kernels.rope_(q, cos, sin, d), kernels.rope_(k, cos, sin, d)
    v = apply(x, self.v_proj.weight, self.v_proj.bias, self.v_proj.cpu_plan.by_rows[rows])
    q, k, v = (t.view(b, m, -1, d).transpose(1, 2) for t in (q, k, v))
    if cache is not None:
        k, v = cache.update(k, v, self.layer_idx)
    out, weights = attend(self, q, k, v, mask, dropout=0.0, scaling=self.scaling, **kwargs)
    return self.o_proj(out.reshape(b, m, -1)), weights


def _cache_slot(attn: nn.Module, x: torch.Tensor, pe, mask, cache):
    """Where `_fused_attention` / `FusedLayer` may run attention module `attn` in C: (cache layer, rows
    already cached) when x is one sequence of at most ATTENTION_ROWS (64) float32 rows, `gqa_sdpa` attention, a
    preallocated cache layer with room for the new rows, rotary tables and a mask the kernel reads (no mask only
    for one row), nothing that needs gradients; else None. (The callers check first that the plan chose the kernel
    for every product.)"""
    if x.dim() != 3 or x.shape[0] != 1 or x.shape[1] > ATTENTION_ROWS or cache is None or pe is None:
        return None
    m = x.shape[1]
    if (not x.is_cpu or x.dtype != torch.float32 or not x.is_contiguous()
            or wants_grad(x, attn.cpu_plan.params[0]["weight"])
            or _attn_implementation(attn.config) not in ATTENTION_NAMES or not _rotary_fits(pe, m, attn.head_dim)):
        return None
    layers = getattr(cache, "layers", None)
    layer = layers[attn.layer_idx] if layers is not None and len(layers) > attn.layer_idx else None
    past = _room(layer, m)
    if past is None:
        return None  # the stock update makes room
    if mask is None:
        return (layer, past) if m == 1 else None
    return (layer, past) if _mask_fits(mask, m, past) else None


def _rotary_fits(pe: tuple, m: int, head_dim: int) -> bool:
    """Rotary tables (cos, sin) the C calls read: [1, m, head_dim] contiguous float32."""
    cos, sin = pe
    return (cos.shape == (1, m, head_dim) and cos.dtype == torch.float32 and sin.shape == cos.shape
            and cos.is_contiguous() and sin.is_contiguous())


def _room(layer, m: int) -> int | None:
    """The positions already cached in `layer` when it is an initialized PreallocatedLayer of one sequence with room
    for m more (the C calls write there in place), else None."""
    if type(layer) is not PreallocatedLayer or not layer.is_initialized or layer._k is None:
        return None
    past = layer.length
    return past if layer._k.shape[0] == 1 and layer._k.shape[2] >= past + m else None


def _mask_fits(mask: torch.Tensor, m: int, past: int) -> bool:
    """A [1, 1, m, >= past + m] bool or additive float32 mask with unit stride along keys, as the C calls read it."""
    return (mask.dim() == 4 and mask.shape[0] == 1 and mask.shape[1] == 1 and mask.shape[2] == m
            and mask.shape[3] >= past + m and mask.dtype in (torch.bool, torch.float32) and mask.stride(-1) == 1)


def _attn_implementation(config) -> str | None:
    """config._attn_implementation without transformers' attribute machinery (~9 us a read here, 30 reads a pass)."""
    try:
        return object.__getattribute__(config, "_attn_implementation_internal")
    except AttributeError:
        return config._attn_implementation


def _projections(attn: nn.Module) -> tuple:
    """(q weight, q bias, ..., o weight, o bias) of an attention module, read from the parameter dicts kept at patch
    time (a submodule's attribute costs ~3-5 us here)."""
    out = []
    for params in attn.cpu_plan.params:
        out += (params["weight"], params.get("bias"))
    return tuple(out)


def _fused_attention(self: nn.Module, x: torch.Tensor, pe, mask, cache) -> torch.Tensor | None:
    """The whole attention module in one C call (`kernels.attention_block`, the same numbers as
    `_attention_kernel` with `gqa_sdpa`) where `_cache_slot` allows it, else None."""
    plan = self.cpu_plan
    slot = _cache_slot(self, x, pe, mask, cache) if plan.rows[min(x.shape[1], MAX_ROWS)] else None
    if slot is None:
        return None
    layer, past = slot
    y = kernels.attention_block(x, _projections(self), *plan.dims, pe[0], pe[1], layer._k, layer._v, past,
                                  mask, self.scaling, _qk_norms(self))
    layer.filled(past + x.shape[1])
    return y


def _qk_norms(attn: nn.Module) -> tuple | None:
    """`kernels.attention_block`'s qk_norms for a planned attention module: None, or its q and k norms' scales
    and epsilon."""
    qk = attn.cpu_plan.qk
    return None if qk is None else (norm_weight(qk[0]), norm_weight(qk[1]), qk[0].cpu_plan.eps)


def _layer_in_one_call(plan: LayerPlan, x: torch.Tensor, pe, mask, layer: PreallocatedLayer, past: int):
    """`kernels.decoder_layer` on a decoder layer planned as `plan` (`_plan_fused_layer`), writing the new keys and
    values into the cache layer after its `past` positions."""
    attn, gate, up, down = plan.parts[0], *plan.parts[3:]
    norm1, norm2, out_attn, out_mlp = plan.norms
    out = None if out_attn is None else (norm_weight(out_attn), out_attn.cpu_plan.eps, norm_weight(out_mlp),
                                         out_mlp.cpu_plan.eps)
    y = kernels.decoder_layer(
        x, (norm_weight(norm1), norm1.cpu_plan.eps, norm_weight(norm2), norm2.cpu_plan.eps), _projections(attn),
        (gate["weight"], up["weight"], down["weight"]), *attn.cpu_plan.dims, pe[0], pe[1], layer._k, layer._v, past,
        mask, attn.scaling, _qk_norms(attn), out, plan.act)
    layer.filled(past + x.shape[1])
    return y


@dataclass
class AttentionPlan:
    # for each row count 0 .. MAX_ROWS, whether the whole module may run in one C call (`_fused_attention`)
    rows: list[bool] = field(default_factory=lambda: [False] * (MAX_ROWS + 1))
    dims: tuple = ()     # (heads, key / value heads, head size)
    params: tuple = ()   # the q, k, v, o projections' parameter dicts (a submodule attribute costs ~3-5 us here)
    qk: tuple | None = None  # its q and k KernelNorms where the C call takes them (Qwen3's, Gemma-3's)


class KernelAttention(BackendModule):
    """A Llama-style attention module: in one C call (`kernels.attention_block`: products, q / k norms, rotary
    embedding, cache write, attention) where `_cache_slot` allows, else its steps with the rotary embedding in C and
    the products called directly (`_attention_kernel`), else (gradients, other devices) its stock forward."""

    cpu_plan: AttentionPlan

    def forward(self, hidden_states: torch.Tensor, *args, **kwargs):
        cache_kw = "cache" if "cache" in kwargs else "past_key_values"
        cache, pe = kwargs.get(cache_kw), kwargs.get("position_embeddings")
        x, impl = hidden_states, self.config._attn_implementation
        if not args and pe is not None:
            y = _fused_attention(self, x, pe, kwargs.get("attention_mask"), cache)
            if y is not None:
                return y, None
        if (args or pe is None or x.dim() != 3 or stock_path(x, self.q_proj.weight) or not x.is_contiguous()
                or pe[0].dim() != 3 or pe[0].shape[0] not in (1, x.shape[0]) or pe[0].shape[1] != x.shape[1]
                or pe[0].shape[2] != self.head_dim or pe[0].dtype != torch.float32
                or (cache is not None and not isinstance(cache, DynamicCache)) or impl not in ALL_ATTENTION_FUNCTIONS):
            return self.stock_forward(hidden_states, *args, **kwargs)
        kw = {k: v for k, v in kwargs.items() if k not in (cache_kw, "position_embeddings", "attention_mask")}
        return _attention_kernel(self, x, pe, kwargs.get("attention_mask"), cache, ALL_ATTENTION_FUNCTIONS[impl], kw)

    def plan_repr(self) -> str:
        return f"one call at {row_spans(self.cpu_plan.rows)} rows"


@dataclass
class LayerPlan:
    parts: tuple        # (attention, the two norms', gate's, up's and down's parameter dicts)
    norms: tuple        # (input norm, post-attention (or pre-MLP) norm, Gemma-3's output norms or None, None)
    act: int            # the MLP's activation (MLPPlan.act)
    rows: list[bool]    # for each row count 0 .. MAX_ROWS, whether the layer runs in one C call


class FusedLayer(BackendModule):
    """A Llama-style decoder layer (or Gemma-3's) in one C call (`kernels.decoder_layer`: norms, attention with its
    cache write, MLP, residual sums) where it applies, else its stock forward (whose parts are backend modules)."""

    cpu_plan: LayerPlan

    def forward(self, hidden_states: torch.Tensor, *args, **kwargs):
        x, plan = hidden_states, self.cpu_plan
        if not args and x.dim() == 3 and x.shape[1] <= MAX_ROWS and plan.rows[x.shape[1]]:
            cache = kwargs["cache"] if "cache" in kwargs else kwargs.get("past_key_values")
            pe, mask = kwargs.get("position_embeddings"), kwargs.get("attention_mask")
            slot = _cache_slot(plan.parts[0], x, pe, mask, cache)
            if slot is not None:
                return _layer_in_one_call(plan, x, pe, mask, *slot)
        return self.stock_forward(hidden_states, *args, **kwargs)

    def plan_repr(self) -> str:
        return f"one call at {row_spans(self.cpu_plan.rows)} rows"


def _is_plain_attention(mod: nn.Module) -> bool:
    """A Llama-style attention module: exactly q / k / v / o projections the kernel takes and no other parts, or
    those and a q and a k norm of one head's size (Qwen3, Gemma-3: `_attention_kernel` only, not the one-call
    paths), a head size, a scaling and a layer index."""
    names = {name for name, _ in mod.named_children()}
    parts = [getattr(mod, n, None) for n in ("q_proj", "k_proj", "v_proj", "o_proj")]
    if names == {"q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm"}:
        sizes = [getattr(getattr(mod, n), "weight", None) for n in ("q_norm", "k_norm")]
        if not all(isinstance(w, torch.Tensor) and w.shape == (getattr(mod, "head_dim", -1),) for w in sizes):
            return False
        names -= {"q_norm", "k_norm"}
    return (names == {"q_proj", "k_proj", "v_proj", "o_proj"}
            and all(isinstance(p, nn.Linear) and kernels.supports(p.weight) and isinstance(p, PackedLinear)
                    for p in parts)
            and isinstance(getattr(mod, "head_dim", None), int) and 0 < mod.head_dim <= 1024 and mod.head_dim % 2 == 0
            and isinstance(getattr(mod, "scaling", None), float) and isinstance(getattr(mod, "layer_idx", None), int)
            and getattr(mod, "attn_logit_softcapping", None) is None  # Gemma-2's: the C attention has no softcap
            and hasattr(getattr(mod, "config", None), "_attn_implementation"))


def _attention_same_as_stock(mod: nn.Module) -> bool:
    """Whether `_attention_kernel` computes what the module's stock forward computes, on three random rows with a
    causal mask and random rotary angles (no cache)."""
    if mod.config._attn_implementation not in ALL_ATTENTION_FUNCTIONS:
        return False
    gen = torch.Generator().manual_seed(0)
    width, d = mod.q_proj.weight.shape[1], mod.head_dim
    x = torch.randn(1, 3, width, generator=gen)
    angles = torch.randn(1, 3, d // 2, generator=gen) * 3
    pe = (torch.cat([angles, angles], -1).cos(), torch.cat([angles, angles], -1).sin())
    mask = torch.ones(3, 3, dtype=torch.bool).tril()[None, None]
    try:
        with torch.no_grad():
            want = type(mod).forward(mod, x, position_embeddings=pe, attention_mask=mask)[0]
            got = _attention_kernel(mod, x, pe, mask, None, ALL_ATTENTION_FUNCTIONS[mod.config._attn_implementation],
                                    {})[0]
    except (TypeError, ValueError, RuntimeError, AttributeError, IndexError):
        return False  # a forward with another signature or contract than Llama's: it keeps its stock forward
    return got.shape == want.shape and torch.allclose(got, want, rtol=1e-4, atol=1e-4 * width ** 0.5)


def _plan_fused_attention(mod: KernelAttention) -> None:
    """Its AttentionPlan: for each row count, whether `_fused_attention` may run the module: the plan chose the kernel
    for all four products, the heads divide evenly, biases (if any) are contiguous float32."""
    projs = [getattr(mod, n) for n in ("q_proj", "k_proj", "v_proj", "o_proj")]
    d = mod.head_dim
    heads, kv_heads = projs[0].weight.shape[0] // d, projs[1].weight.shape[0] // d
    fits = (projs[0].weight.shape[0] == heads * d and projs[1].weight.shape == projs[2].weight.shape
            and projs[1].weight.shape[0] == kv_heads * d and kv_heads > 0 and heads % kv_heads == 0 and d % 8 == 0
            and projs[3].weight.shape[1] == heads * d
            and all(p.bias is None or (p.bias.dtype == torch.float32 and p.bias.is_contiguous()) for p in projs))
    plan = mod.cpu_plan
    plan.dims, plan.params, plan.qk = (heads, kv_heads, d), tuple(p._parameters for p in projs), None
    if "q_norm" in mod._modules:  # Qwen3's, Gemma-3's: taken in C where both run their kernels with one epsilon
        qn, kn = mod.q_norm, mod.k_norm
        same = (isinstance(qn, KernelNorm) and isinstance(kn, KernelNorm) and qn.cpu_plan.eps == kn.cpu_plan.eps)
        plan.qk, fits = ((qn, kn) if same else None), fits and same
    plan.rows = [fits and 0 < rows <= ATTENTION_ROWS and all(p.cpu_plan.by_rows[rows] == "kernel" for p in projs)
                 for rows in range(MAX_ROWS + 1)]


LAYER_PARTS = {"self_attn", "mlp", "input_layernorm", "post_attention_layernorm"}
# Gemma-2/3's layers: post_attention_layernorm norms the attention's output, pre_feedforward_layernorm the MLP's
# input, post_feedforward_layernorm its output
NORMED_OUTPUT_PARTS = LAYER_PARTS | {"pre_feedforward_layernorm", "post_feedforward_layernorm"}


def _plan_fused_layer(mod: nn.Module) -> LayerPlan | None:
    """Where `mod` looks like a Llama decoder layer (or a Gemma-3 one: its attention's and MLP's outputs normed,
    `NORMED_OUTPUT_PARTS`) whose norms, attention and MLP are all backend modules: its parts and, for each row
    count, whether `FusedLayer` may run it in one call; else None."""
    parts = dict(mod.named_children())
    if set(parts) == LAYER_PARTS:
        names = ("input_layernorm", "post_attention_layernorm")
    elif set(parts) == NORMED_OUTPUT_PARTS:
        names = ("input_layernorm", "pre_feedforward_layernorm", "post_attention_layernorm",
                 "post_feedforward_layernorm")
    else:
        return None
    attn, mlp, norms = parts["self_attn"], parts["mlp"], [parts[n] for n in names]
    if not (isinstance(attn, KernelAttention) and isinstance(mlp, KernelMLP)
            and all(isinstance(n, KernelNorm) and n.weight.shape == (mlp.down_proj.weight.shape[0],) for n in norms)):
        return None
    return LayerPlan(parts=(attn, norms[0]._parameters, norms[1]._parameters, mlp.gate_proj._parameters,
                            mlp.up_proj._parameters, mlp.down_proj._parameters),
                     norms=(*norms, None, None)[:4], act=mlp.cpu_plan.act, rows=_layer_rows(attn, mlp))


def _layer_rows(attn: KernelAttention, mlp: KernelMLP) -> list[bool]:
    """For each row count, whether a layer of these parts runs in one call: the plan chose the kernel for all its
    products at that count."""
    return [attn.cpu_plan.rows[rows] and mlp.gate_proj.cpu_plan.by_rows[rows] == "kernel"
            and mlp.down_proj.cpu_plan.by_rows[rows] == "kernel" for rows in range(MAX_ROWS + 1)]


def _layer_same_as_stock(mod: nn.Module, plan: LayerPlan) -> bool:
    """Whether the one-call layer (`plan`) computes what the layer's own forward computes (with its backend parts):
    two rows after three cached ones with a causal mask, then one more row without a mask, on random inputs, each
    path with its own preallocated cache holding the same past."""
    attn = plan.parts[0]
    kv_heads, d = attn.cpu_plan.dims[1:]
    hid = plan.parts[1]["weight"].shape[0]
    gen = torch.Generator().manual_seed(0)
    past_k, past_v = torch.randn(2, 1, kv_heads, 3, d, generator=gen)
    try:
        caches = [preallocated_cache() for _ in range(2)]
        for cache in caches:
            for i in range(attn.layer_idx + 1):
                cache.update(past_k.clone(), past_v.clone(), i)
        cache_kw = "cache" if "cache" in inspect.signature(type(mod).forward).parameters else "past_key_values"
        with torch.no_grad():
            for m, mask in ((2, torch.ones(2, 5, dtype=torch.bool).tril(3)[None, None]), (1, None)):
                x = torch.randn(1, m, hid, generator=gen)
                angles = torch.randn(1, m, d // 2, generator=gen) * 3
                pe = (torch.cat([angles, angles], -1).cos(), torch.cat([angles, angles], -1).sin())
                want = type(mod).forward(mod, x, attention_mask=mask, position_embeddings=pe,
                                         **{cache_kw: caches[0]})
                want = want[0] if isinstance(want, tuple) else want
                layer = caches[1].layers[attn.layer_idx]
                got = _layer_in_one_call(plan, x, pe, mask, layer, layer.keys.shape[-2])
                if not (got.shape == want.shape and torch.allclose(got, want, rtol=1e-4, atol=1e-4 * hid ** 0.5)):
                    return False
    except (TypeError, ValueError, RuntimeError, AttributeError, IndexError, KeyError):
        return False  # a layer with another contract than Llama's keeps its own forward
    return True


STACK_KWARGS = {"input_ids", "attention_mask", "position_ids", "cache", "past_key_values", "use_cache",
                "output_hidden_states", "output_attentions", "return_dict", "cache_position"}


@dataclass
class StackPlan:
    dims: tuple        # (heads, key / value heads, head size, intermediate size, attention scale)
    rows: list[bool]   # for each row count 0 .. MAX_ROWS, whether every layer runs in one C call
    slots: list | None = None  # (parameter dict, name) of every layer's weights, in `decoder_stack`'s table order
    table: tuple | None = None  # (weights' key, LayerArgs, cache buffers, C table, layouts held): `_stack_table`
    cache_mark: tuple | None = None  # (the cache, `table`, buffers made, switches) of the last pass
    rope: tuple | None = None  # (inv_freq, key, cos, sin): `_rotary`'s table

    def __deepcopy__(self, memo) -> "StackPlan":
        # the tables hold C addresses of this model's weights and caches (ctypes, which cannot be copied): a copy of
        # the model (a bfloat16 feature pass's) makes its own from its own weights
        return StackPlan(dims=copy.deepcopy(self.dims, memo), rows=list(self.rows))


class FusedStack(BackendModule):
    """A Llama-style base model with all its decoder layers in one C call (`kernels.decoder_stack`) where
    `_stack_call` allows, else its stock forward (whose layers are FusedLayers themselves)."""

    cpu_plan: StackPlan

    def forward(self, *args, **kwargs):
        out = None if args else _stack_call(self, kwargs, self.cpu_plan)
        return out if out is not None else self.stock_forward(*args, **kwargs)

    def plan_repr(self) -> str:
        return f"all layers in one call at {row_spans(self.cpu_plan.rows)} rows"


def _plan_stack(mod: nn.Module) -> StackPlan | None:
    """Where `mod` looks like a Llama-style base model whose decoder layers all run in one call each: an
    `embed_tokens` embedding, a ModuleList `layers` of FusedLayers with the same sizes and layer indices 0, 1, ...,
    a `norm` and a `rotary_emb`, full attention in every layer: its StackPlan, with for each row count whether
    `FusedStack` may run every layer in one C call; else None."""
    layers, config = getattr(mod, "layers", None), getattr(mod, "config", None)
    if not (isinstance(layers, nn.ModuleList) and len(layers) and isinstance(getattr(mod, "embed_tokens", None),
                                                                             nn.Embedding)
            and isinstance(getattr(mod, "norm", None), nn.Module) and isinstance(getattr(mod, "rotary_emb", None),
                                                                                   nn.Module)
            and all(isinstance(layer, FusedLayer) and _llama_layer(layer.cpu_plan) for layer in layers)):
        return None
    if (getattr(config, "num_hidden_layers", None) != len(layers) or getattr(config, "sliding_window", None)
            or any(t != "full_attention" for t in getattr(config, "layer_types", None) or ())):
        return None  # sliding-window layers need masks a one-row pass does not get
    attns = [layer.cpu_plan.parts[0] for layer in layers]
    sizes = {(a.cpu_plan.dims, float(a.scaling), layer.cpu_plan.parts[3]["weight"].shape)
             for a, layer in zip(attns, layers)}
    if len(sizes) != 1 or [a.layer_idx for a in attns] != list(range(len(layers))):
        return None
    (dims, scale, gate_shape), = sizes
    return StackPlan(dims=(*dims, gate_shape[0], scale),
                     rows=[all(layer.cpu_plan.rows[rows] for layer in layers) for rows in range(MAX_ROWS + 1)])


def _llama_layer(plan: LayerPlan) -> bool:
    """Whether a fused layer is Llama's alone (what `decoder_stack`'s table holds): no q / k norms, no normed
    outputs, no norm scaled by 1 + weight, SiLU."""
    return ("q_norm" not in plan.parts[0]._modules and plan.norms[2] is None and plan.act == 0
            and not any(n.cpu_plan.offset for n in plan.norms[:2]))


def _stack_table(mod: nn.Module, plan: StackPlan, cache: DynamicCache):
    """`kernels.decoder_stack`'s table (an array of LayerArgs): the weights' part made again only when a weight
    changed in place or moved, or the kernel library or the switches changed (as `kernels.packed` would), the caches'
    part when their buffers moved. The weights are read once per cache (a cache belongs to one
    set of weights): later passes with the same cache reuse the table while no buffer was made since."""
    setting = (id(kernels._lib), switches.current(), kernels.amx_on())
    kept, mark = plan.table, plan.cache_mark
    if (mark is not None and mark[0]() is cache and mark[1] is kept
            and mark[2:] == (PreallocatedLayer.buffers_made, setting)):
        return kept[3]
    slots = plan.slots
    if slots is None:  # (parameter dict, name) of every weight: the modules' live dicts, so a replaced one is seen
        slots = plan.slots = [(d, name) for layer in mod.layers for d, name in _stack_slots(layer.cpu_plan)]
    key = [*setting, *((weight_layouts.version(w), w.data_ptr()) for w in (d[name] for d, name in slots))]
    buffers = [(c._k, c._v) for c in cache.layers]
    made_for = [(k.data_ptr(), v.data_ptr(), k.stride(1)) for k, v in buffers]
    if kept is None or kept[0] != key:
        layers = []
        for layer in mod.layers:
            attn, norm1, norm2, gate, up, down = layer.cpu_plan.parts
            n1, n2 = layer.cpu_plan.norms[:2]
            layers.append(kernels.layer_args(_projections(attn), (norm1["weight"], n1.cpu_plan.eps, norm2["weight"],
                                                                  n2.cpu_plan.eps),
                                             (gate["weight"], up["weight"], down["weight"])))
        # the layouts behind those addresses, held: a weight changed in place and then multiplied elsewhere gets a new
        # layout, and the old one must outlive the passes that still read it (until this cache is done)
        copies = [dict(weight_layouts.layouts(d[name]).made) for d, name in slots]
        kept = plan.table = (key, layers, None, None, copies)
    key, layers, table_for, table, copies = kept
    if table_for != made_for:  # the cache's buffers moved (a new cache, or one grown): their addresses again
        for args, (k, v) in zip(layers, buffers):
            args.k_cache, args.v_cache, args.kv_sh = k.data_ptr(), v.data_ptr(), k.stride(1)
        kept = plan.table = (key, layers, made_for, kernels.stack_layers(layers), copies)
    plan.cache_mark = (weakref.ref(cache), kept, PreallocatedLayer.buffers_made, setting)
    return kept[3]


def _stack_slots(plan: LayerPlan) -> list:
    """(parameter dict, name) of a fused layer's weights: its norms', its attention's (and biases), its MLP's."""
    attn, norm1, norm2, gate, up, down = plan.parts
    projs = [(d, name) for d in attn.cpu_plan.params for name in ("weight", "bias") if d.get(name) is not None]
    return [(norm1, "weight"), (norm2, "weight"), *projs, (gate, "weight"), (up, "weight"), (down, "weight")]


def _rotary(mod: nn.Module, plan: StackPlan, x: torch.Tensor, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The model's rotary (cos, sin) at position ids pos [1, m]: for the default rope type, rows of a table the
    rotary module made itself in one call, of the first 4,096 positions or a power of two more as later passes need
    (each entry depends only on its own position: the same bits, checked in the tests); else, and past the model's
    maximum, the module's own call."""
    rot = mod.rotary_emb
    size = getattr(mod.config, "max_position_embeddings", 0) or 0
    if getattr(rot, "rope_type", None) != "default" or size <= 0:
        return rot(x, position_ids=pos)
    inv = rot.inv_freq
    key = (weight_layouts.version(inv), x.dtype, float(rot.attention_scaling))
    table = plan.rope
    if table is not None and table[0] is inv and table[1] == key:
        try:
            return table[2].index_select(1, pos[0]), table[3].index_select(1, pos[0])
        except (IndexError, RuntimeError):  # a position past the table (or before it): make it again, or not
            pass
    need = int(pos.max()) + 1
    if int(pos.min()) < 0 or need > size:
        return rot(x, position_ids=pos)
    n = min(size, max(4096, 1 << math.ceil(math.log2(need))))
    cos, sin = rot(x[:, :1], position_ids=torch.arange(n, device=x.device)[None])
    plan.rope = (inv, key, cos, sin)
    return cos.index_select(1, pos[0]), sin.index_select(1, pos[0])


def _stack_call(mod: nn.Module, kwargs: dict, plan: StackPlan):
    """The base model's output with every decoder layer in one C call (`kernels.decoder_stack`) where that
    computes what its own forward (with one call per layer) computes, else None: input ids of one sequence of at
    most 64 rows with position ids, `gqa_sdpa` attention, a preallocated cache with room in every layer, the mask
    `_cache_slot` takes, no attention weights asked for, no gradients."""
    ids, pos = kwargs.get("input_ids"), kwargs.get("position_ids")
    cache = kwargs["cache"] if "cache" in kwargs else kwargs.get("past_key_values")
    mask = kwargs.get("attention_mask")
    if (not set(kwargs) <= STACK_KWARGS or kwargs.get("use_cache") is False or kwargs.get("output_attentions")
            or not isinstance(ids, torch.Tensor) or ids.dim() != 2 or ids.shape[0] != 1
            or not 0 < ids.shape[1] <= MAX_ROWS or not plan.rows[ids.shape[1]]
            or not isinstance(pos, torch.Tensor) or pos.shape != ids.shape or torch.is_grad_enabled()
            or not isinstance(cache, DynamicCache) or len(cache.layers) != len(mod.layers)
            or _attn_implementation(mod.config) not in ATTENTION_NAMES):
        return None
    m = ids.shape[1]
    layers = cache.layers
    past = _room(layers[0], m)
    if past is None or any(_room(layer, m) != past for layer in layers):
        return None
    if mask is None and m > 1:  # causal over the new rows, as transformers makes it after a cached past
        if past == 0:
            return None  # no mask at all there (sdpa's is_causal): the layers run their parts
        mask = torch.ones(m, past + m, dtype=torch.bool).tril(past)[None, None]
    if mask is not None and not _mask_fits(mask, m, past):
        return None
    x = mod.embed_tokens(ids)
    cos, sin = _rotary(mod, plan, x, pos)
    heads, kv_heads, d, inter, scale = plan.dims
    if x.dtype != torch.float32 or not x.is_cpu or not x.is_contiguous() or not _rotary_fits((cos, sin), m, d):
        return None
    table = _stack_table(mod, plan, cache)
    want = kwargs.get("output_hidden_states")
    keep = x.new_empty(len(layers) - 1, 1, m, x.shape[2]) if (getattr(mod.config, "output_hidden_states", False)
                                                              if want is None else want) else None
    y = kernels.decoder_stack(x, table, heads, kv_heads, d, inter, cos, sin, past, mask, scale, keep)
    for layer in layers:
        layer.filled(past + m)
    out = {"last_hidden_state": mod.norm(y)}
    if keep is not None:  # as transformers' tuple: the embeddings, every layer's output, the last one normed
        out["hidden_states"] = (x, *keep.unbind(0), out["last_hidden_state"])
    out["cache" if "cache" in BaseModelOutputWithPast.__dataclass_fields__ else "past_key_values"] = cache
    return BaseModelOutputWithPast(**out)


def _stack_same_as_stock(mod: nn.Module, plan: StackPlan) -> bool:
    """Whether the one-call stack gives exactly the base model's own forward (its layers one call each): three
    rows after five cached positions with a tree mask, then one row without a mask (each where the stack takes
    that many rows), on random token ids, each path with its own preallocated cache."""
    gen = torch.Generator().manual_seed(0)
    vocab = mod.embed_tokens.weight.shape[0]
    ids = torch.randint(0, vocab, (1, 9), generator=gen)
    cache_kw = "cache" if "cache" in inspect.signature(type(mod).forward).parameters else "past_key_values"
    tree = torch.tensor([[1, 0, 0], [1, 1, 0], [1, 0, 1]], dtype=torch.bool)
    mask = torch.cat([torch.ones(3, 5, dtype=torch.bool), tree], dim=1)[None, None]
    steps = [(slice(0, 5), None), (slice(5, 8), mask), (slice(8, 9), None)]
    checked = 0
    try:
        outs = []
        for fused in (False, True):
            cache, got = preallocated_cache(), []
            with torch.no_grad():
                for cut, m in steps:
                    kw = {"input_ids": ids[:, cut], "position_ids": torch.arange(cut.start, cut.stop)[None],
                          "attention_mask": m, cache_kw: cache, "use_cache": True}
                    try_stack = fused and cut.start and plan.rows[cut.stop - cut.start]
                    out = _stack_call(mod, kw, plan) if try_stack else None
                    if try_stack and out is None:
                        return False
                    checked += bool(try_stack)
                    got.append((out if out is not None else type(mod).forward(mod, **kw)).last_hidden_state)
            outs.append(got)
    except (TypeError, ValueError, RuntimeError, AttributeError, IndexError, KeyError):
        return False
    return checked > 0 and all(torch.equal(a, b) for a, b in zip(*outs))


# base models whose one-call stack passed `_stack_same_as_stock`: the check is of the code paths, and a calibration
# enables a model many times
_checked_stacks: weakref.WeakSet = weakref.WeakSet()


def patch(model: nn.Module) -> None:
    """Give Llama-style attention modules, then decoder layers whose parts are all backend modules, then base models
    whose layers all are FusedLayers the backend's classes, where checks on random inputs show that they compute
    what the stock forward computes; modules that have them already get rows for the linear layers' new plan."""
    for mod in stock_modules_on_cpu(model):
        if _is_plain_attention(mod) and _attention_same_as_stock(mod):
            KernelAttention.from_stock(mod, AttentionPlan())
    for mod in model.modules():  # attention modules, once their q / k norms (which come after them) are swapped
        if isinstance(mod, KernelAttention):
            _plan_fused_attention(mod)
    for mod in model.modules():  # decoder layers whose parts are all backend modules (the loops above came first)
        if isinstance(mod, FusedLayer):  # enabled again with another plan (a calibration does): its rows anew
            mod.cpu_plan.rows = _layer_rows(mod.cpu_plan.parts[0], mod.mlp)
        elif not isinstance(mod, BackendModule) and (plan := _plan_fused_layer(mod)) is not None:
            if _layer_same_as_stock(mod, plan):
                FusedLayer.from_stock(mod, plan)
    for mod in model.modules():  # base models whose decoder layers all run in one call each
        if isinstance(mod, FusedStack):
            mod.cpu_plan.rows = [all(layer.cpu_plan.rows[rows] for layer in mod.layers) for rows in range(MAX_ROWS + 1)]
        elif not isinstance(mod, BackendModule) and (plan := _plan_stack(mod)) is not None:
            if mod in _checked_stacks or _stack_same_as_stock(mod, plan):
                _checked_stacks.add(mod)
                FusedStack.from_stock(mod, plan)
