"""The CPU backend's objects: `cpu_backend.enable` gives modules the backend's own classes (the same objects,
parameters and names) and hangs nothing on torch's; `disable` gives every stock class back and the stock numbers
bit for bit; the C `layer_args` struct and its ctypes mirror agree."""

import copy
import ctypes
import pickle
import pickletools
import sys
from pathlib import Path

import pytest
import torch
from torch import nn
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

import cpu_backend
from cpu_backend import kernels
from cpu_backend.plan import BUCKETS, Plan
from cpu_backend.modules import BackendModule
from tests.tiny import tiny_head, tiny_target

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import backend_modules  # noqa: E402

needs_kernel = pytest.mark.skipif(not kernels.available(), reason="the C kernel does not build here")


@needs_kernel
def test_layer_args_mirror_the_headers_struct():
    lib = kernels.library()
    names = lib.layer_args_fields().decode().rstrip(",").split(",")
    out = (ctypes.c_int64 * (len(names) + 1))()
    assert lib.layer_args_layout(out) == len(names)
    mirror = kernels.LayerArgs
    assert [name for name, _ in mirror._fields_] == names
    assert list(out) == [ctypes.sizeof(mirror), *(getattr(mirror, name).offset for name in names)]


@needs_kernel
def test_enable_swaps_classes_keeps_parameters_and_disable_gives_the_stock_model_back():
    target = tiny_target(dtype=torch.float32, hidden=64, layers=2)
    head = tiny_head(target).float()
    model = target.model
    ids = torch.tensor([[5, 9, 14, 22, 7, 3]])
    with torch.no_grad():
        want = model(ids).logits
    types = {name: type(m) for name, m in model.named_modules()}
    types_attention = model.config._attn_implementation
    attributes = [backend_modules.tensor_attributes(m) for m in (model, head)]
    params = dict(model.named_parameters())
    kernel = Plan(layouts={f"{m.weight.shape[0]}x{m.weight.shape[1]}": {b: "kernel" for b in BUCKETS}
                           for m in [*model.modules(), *head.modules()] if isinstance(m, nn.Linear)})
    cpu_backend.enable(model, plan=kernel)
    cpu_backend.enable(head, plan=kernel, drafts=True)
    assert [backend_modules.instance_forwards(m) for m in (model, head)] == [[], []]
    assert [backend_modules.tensor_attributes(m) for m in (model, head)] == attributes  # nothing hung on tensors
    assert list(dict(model.named_parameters())) == list(params)
    assert all(params[k] is p for k, p in model.named_parameters())
    kinds = {type(m).__name__ for m in [*model.modules(), *head.modules()] if isinstance(m, BackendModule)}
    assert {"PackedLinear", "KernelNorm", "KernelMLP", "KernelAttention", "FusedLayer", "FusedStack",
            "DraftingHead", "HeadAttention", "HeadLayer"} <= kinds
    layer = model.model.layers[0]
    assert isinstance(layer, type(layer).stock) and "FusedLayer(LlamaDecoderLayer)" in repr(model)
    assert type(copy.copy(layer)) is type(layer) and copy.copy(layer).cpu_plan is layer.cpu_plan
    assert "PackedLinear(Linear)(in_features=64" in repr(layer.self_attn)
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, want, rtol=1e-4, atol=1e-4)
        # no cache: the stack's stock forward, which must still record every layer's hidden state (EAGLE-3)
        hidden = model.model(input_ids=ids, output_hidden_states=True).hidden_states
        assert hidden is not None and len(hidden) == model.config.num_hidden_layers + 1
        twin = copy.deepcopy(model)  # a copy of an enabled model (train's bfloat16 feature pass makes one) runs alone
        torch.testing.assert_close(twin(ids).logits, want, rtol=1e-4, atol=1e-4)
    assert type(twin.model) is type(model.model) and "cpu_plan" in twin.model.__dict__
    cpu_backend.disable(twin)  # the copy goes back to the attention the original had
    assert twin.config._attn_implementation == types_attention
    cpu_backend.disable(head)
    cpu_backend.disable(model)
    assert model.config._attn_implementation == types_attention
    assert {name: type(m) for name, m in model.named_modules()} == types
    assert not any(isinstance(m, BackendModule) or "cpu_plan" in m.__dict__
                   for m in [*model.modules(), *head.modules()])
    with torch.no_grad():
        assert torch.equal(model(ids).logits, want)


def test_an_enabled_model_pickles_whole_as_its_stock_modules():
    # torch.save of a whole model (not its state_dict) while the backend is on: the stock classes, no plan, and the
    # attention under a name the backend registers on import (so the file loads wherever cpu_backend is imported)
    model = tiny_target(dtype=torch.float32).model
    cpu_backend.enable(model, plan=Plan())
    assert any(isinstance(m, BackendModule) for m in model.modules())
    data = pickle.dumps(model)
    names = {arg for _, arg, _ in pickletools.genops(data) if isinstance(arg, str)}
    assert {"LlamaDecoderLayer", "Linear"} <= names
    assert not names & {"PackedLinear", "FusedLayer", "FusedStack", "cpu_plan", "LinearPlan", "StackPlan"}
    assert model.config._attn_implementation in ALL_ATTENTION_FUNCTIONS
    cpu_backend.disable(model)


@pytest.mark.smollm
@needs_kernel
def test_smollm2_backend_modules_check():
    # the check on the real target: benchmarks/backend_modules.py
    result = backend_modules.check("smollm2-135m")
    assert [k for k, v in result.items() if v is False] == [], result
    assert result["backend_modules"]["FusedStack(LlamaModel)"] == 1
    assert result["backend_modules"]["FusedLayer(LlamaDecoderLayer)"] == 30


@needs_kernel
def test_enabling_again_with_another_plan_routes_the_layers_by_it():
    # a calibration enables one model with each layout in turn: the one-call layers and stack follow the new plan
    model = tiny_target(dtype=torch.float32, hidden=64, layers=2).model
    shapes = {f"{m.weight.shape[0]}x{m.weight.shape[1]}" for m in model.modules() if isinstance(m, nn.Linear)}
    kernel, linear = (Plan(layouts={k: {b: layout for b in BUCKETS} for k in shapes}) for layout in ("kernel", "linear"))
    layers = model.model.layers
    for plan, one_call in ((kernel, True), (linear, False), (kernel, True)):
        cpu_backend.enable(model, plan=plan)
        assert [layer.cpu_plan.rows[1] for layer in layers] == [one_call] * 2
        assert model.model.cpu_plan.rows[1] == one_call
    cpu_backend.disable(model)


def test_switches_come_from_the_environment_at_enable_unless_code_chose_them(monkeypatch):
    from cpu_backend import switches
    from cpu_backend.switches import Switches

    assert Switches.from_env({}) == Switches()
    env = {"EAGLE_NO_AMX": "1", "EAGLE_NO_VNNI": "", "EAGLE_BF16_DRAFTS": "yes", "EAGLE_RECALIBRATE": "1"}
    assert Switches.from_env(env) == Switches(amx=False, int8_drafts=False, recalibrate=True)
    # the paths' key names every switch that changes which code computes a product, and only those
    assert "amx=False" in Switches(amx=False).product_key() and "recalibrate" not in Switches().product_key()
    monkeypatch.setattr(switches, "_current", None)
    monkeypatch.setattr(switches, "_chosen", False)
    model = tiny_target(dtype=torch.float32).model
    plan = Plan(layouts={f"{m.weight.shape[0]}x{m.weight.shape[1]}": {b: "kernel" for b in BUCKETS}
                         for m in model.modules() if isinstance(m, torch.nn.Linear)})
    monkeypatch.setenv("EAGLE_NO_Q4", "1")
    cpu_backend.enable(model, plan=plan)  # read now, not at import
    assert switches.current().q4_1 is False
    monkeypatch.delenv("EAGLE_NO_Q4")
    chosen = Switches(vnni=False)
    switches.use(chosen)
    cpu_backend.enable(model, plan=plan)  # code chose: the environment is not read again
    assert switches.current() is chosen
    switches.use(None)  # the environment's again
    assert switches.current() == Switches.from_env()
    cpu_backend.disable(model)


@needs_kernel
def test_routes_say_what_runs_where():
    target = tiny_target(dtype=torch.float32, hidden=64, layers=2)
    model = target.model
    kernel = Plan(layouts={f"{m.weight.shape[0]}x{m.weight.shape[1]}": {b: "kernel" for b in BUCKETS}
                           for m in model.modules() if isinstance(m, nn.Linear)})
    cpu_backend.enable(model, plan=kernel)
    with torch.no_grad():
        model(torch.tensor([[5, 9, 14]]))
    routes = {r.module: r for r in cpu_backend.routes(model)}
    assert len(routes) == sum(isinstance(m, BackendModule) for m in model.modules())
    q = routes["model.layers.0.self_attn.q_proj"]
    assert (q.runs, q.plan, q.weight) == ("PackedLinear(Linear)", "kernel at 1-256 rows", "float32 copy")
    assert routes["model"].runs == "FusedStack(LlamaModel)" and routes["model.layers.1"].plan.startswith("one call")
    table = cpu_backend.Route.table(list(routes.values())).splitlines()
    assert table[0].startswith("C kernels: True") and len(table) == len(routes) + 2
    cpu_backend.disable(model)
    assert cpu_backend.routes(model) == []
