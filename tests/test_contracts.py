"""`eagle check DIR --for vllm|sglang|llama.cpp`: the loaders' rules (eagle.contracts) on our exports and on the
published layouts (`yuhuili/EAGLE-*`, `yuhuili/EAGLE3-*`, SpecForge's output) rebuilt as tiny fixtures; every rule
has a fixture that breaks it, and is then the line that says so."""

import copy
import json

import pytest
import torch
from safetensors.torch import save_file
from tiny import tiny_target

import eagle_cli
from eagle import EagleHead
from eagle.contracts import LLAMACPP_CONVERTER_RULES, LLAMACPP_GGUF_RULES, SGLANG_RULES, VLLM_RULES, check_head, \
    read_head
from eagle.head import make_head
from eagle.head_config import HeadConfig
from eagle.interop import export_published

H, HEADS, KV, HD, INTER, V, VD = 16, 2, 1, 8, 32, 64, 16


def common(**kw) -> dict:
    return {"model_type": "llama", "hidden_size": H, "intermediate_size": INTER, "num_attention_heads": HEADS,
            "num_key_value_heads": KV, "num_hidden_layers": 1, "vocab_size": V, "rms_norm_eps": 1e-5,
            "tie_word_embeddings": False, **kw}


def layer(prefix: str, width: int) -> dict:
    return {f"{prefix}self_attn.q_proj.weight": (HEADS * HD, width), f"{prefix}self_attn.k_proj.weight": (KV * HD, width),
            f"{prefix}self_attn.v_proj.weight": (KV * HD, width), f"{prefix}self_attn.o_proj.weight": (H, HEADS * HD),
            f"{prefix}mlp.gate_proj.weight": (INTER, H), f"{prefix}mlp.up_proj.weight": (INTER, H),
            f"{prefix}mlp.down_proj.weight": (H, INTER), f"{prefix}post_attention_layernorm.weight": (H,)}


def yuhuili_eagle1(bias: bool = False) -> tuple[dict, dict]:
    """EAGLE-LLaMA3-Instruct-8B's layout (`bias: false`); older EAGLE-1 heads have `bias: true` and fc.bias."""
    shapes = {"fc.weight": (H, 2 * H), **layer("layers.0.", H)}
    if bias:
        shapes["fc.bias"] = (H,)
    return common(architectures=["LlamaForCausalLM"], bias=bias), shapes


def yuhuili_eagle3() -> tuple[dict, dict]:
    """EAGLE3-LLaMA3.1-Instruct-8B's layout: midlayer.*, d2t offsets, t2d, no fused-layer ids (the defaults)."""
    shapes = {"fc.weight": (H, 3 * H), "norm.weight": (H,), "lm_head.weight": (VD, H), "d2t": (VD,), "t2d": (V,),
              **layer("midlayer.", 2 * H), "midlayer.hidden_norm.weight": (H,),
              "midlayer.input_layernorm.weight": (H,)}
    return common(architectures=["LlamaForCausalLMEagle3"], draft_vocab_size=VD), shapes


def specforge() -> tuple[dict, dict]:
    """SpecForge's to_hf export: the EAGLE-3 layout with its embedding and the fused layers nested (layer outputs)."""
    raw, shapes = yuhuili_eagle3()
    raw["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": [1, 2, 3], "use_aux_hidden_state": True}
    return raw, {**shapes, "embed_tokens.weight": (V, H)}


def write(path, raw: dict, shapes: dict, dtypes: dict | None = None):
    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps(raw))
    dtypes = {"d2t": torch.int64, "t2d": torch.bool, **(dtypes or {})}
    save_file({k: torch.zeros(s, dtype=dtypes.get(k, torch.float32)) for k, s in shapes.items()},
              str(path / "model.safetensors"))
    return path


def broken(path, engine) -> set[str]:
    return {line.split(":")[0] for line in check_head(path, engine)}


@pytest.mark.parametrize("layout, engine, expected", [
    (yuhuili_eagle1, "vllm", set()),
    (yuhuili_eagle1, "sglang", {"sglang.architectures", "sglang.eagle1.fc_bias"}),
    # an older EAGLE-1 head: vLLM drops its fc bias and reads `bias: true` as an attention bias it never fills
    (lambda: yuhuili_eagle1(bias=True), "vllm", {"vllm.eagle1.fc_bias", "vllm.config_bias"}),
    (yuhuili_eagle1, "llama.cpp", {"llama.cpp.converter.detect"}),
    (yuhuili_eagle3, "vllm", set()),
    (yuhuili_eagle3, "sglang", set()),
    (yuhuili_eagle3, "llama.cpp", set()),
    (specforge, "vllm", {"vllm.eagle3.aux_layer_ids"}),
    (specforge, "sglang", set()),
    (specforge, "llama.cpp", {"llama.cpp.converter.aux_layer_ids"}),
])
def test_the_published_layouts_against_each_loader(tmp_path, layout, engine, expected):
    assert broken(write(tmp_path / "h", *layout()), engine) == expected


def _mutate(layout, raw_edit=None, add=None, drop=(), dtypes=None):
    def make():
        raw, shapes = layout()[:2]
        raw, shapes = copy.deepcopy(raw), dict(shapes)
        if raw_edit:
            raw_edit(raw)
        shapes.update(add or {})
        for k in drop:
            del shapes[k]
        return raw, shapes, dtypes
    return make


def _set(**kw):
    return lambda raw: raw.update(kw)


def _nested_only(raw):
    raw["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": [0, 3, 4]}


def _top_only(raw):
    raw["eagle_aux_hidden_state_layer_ids"] = [1, 3, 4]


sglang_eagle1 = _mutate(lambda: yuhuili_eagle1(bias=True), _set(architectures=["LlamaForCausalLMEagle"]))
BREAKERS = {  # rule -> (a fixture that breaks it, the engine)
    "vllm.architectures": (_mutate(yuhuili_eagle1, _set(architectures=["MistralForCausalLM"])), "vllm"),
    "vllm.unknown_tensor": (_mutate(yuhuili_eagle3, add={"mtp.proj.weight": (H, H)}), "vllm"),
    "vllm.shapes": (_mutate(yuhuili_eagle3, add={"fc.weight": (H, 3 * H - 1)}), "vllm"),
    "vllm.eagle1.fc_bias": (_mutate(yuhuili_eagle1, add={"fc.bias": (H,)}), "vllm"),
    "vllm.config_bias": (_mutate(yuhuili_eagle3, _set(attention_bias=True)), "vllm"),
    "vllm.eagle3.config_variant": (_mutate(yuhuili_eagle3, _set(fc_norm=True)), "vllm"),
    "vllm.eagle1.layer0_input_norm": (_mutate(yuhuili_eagle1, add={"layers.0.input_layernorm.weight": (H,)}),
                                      "vllm"),
    "vllm.eagle1.no_norm_or_lm_head": (_mutate(yuhuili_eagle1, add={"norm.weight": (H,)}), "vllm"),
    "vllm.eagle3.d2t": (_mutate(yuhuili_eagle3, drop=("d2t",)), "vllm"),
    "vllm.eagle3.aux_layer_ids": (_mutate(yuhuili_eagle3, _nested_only), "vllm"),
    "sglang.architectures": (_mutate(yuhuili_eagle3, _set(architectures=["LlamaForCausalLM"])), "sglang"),
    "sglang.shapes": (_mutate(specforge, add={"lm_head.weight": (VD - 1, H)}), "sglang"),
    "sglang.eagle1.fc_bias": (_mutate(sglang_eagle1, drop=("fc.bias",)), "sglang"),
    "sglang.eagle1.layer0_input_norm": (_mutate(sglang_eagle1, add={"layers.0.input_layernorm.weight": (H,)}),
                                        "sglang"),
    "sglang.eagle3.d2t": (_mutate(specforge, dtypes={"d2t": torch.float32}), "sglang"),
    "sglang.eagle3.norm_before_residual": (_mutate(specforge, _set(norm_before_residual=True)), "sglang"),
    "sglang.eagle3.aux_layer_ids": (_mutate(yuhuili_eagle3, _top_only), "sglang"),
    "llama.cpp.converter.detect": (_mutate(yuhuili_eagle3, lambda raw: raw.pop("draft_vocab_size")), "llama.cpp"),
    "llama.cpp.converter.aux_layer_ids": (_mutate(yuhuili_eagle3, _nested_only), "llama.cpp"),
    "llama.cpp.converter.d2t": (_mutate(yuhuili_eagle3, dtypes={"d2t": torch.int32}), "llama.cpp"),
}


def test_every_directory_rule_has_a_fixture_that_breaks_it():
    assert sorted(BREAKERS) == sorted(r.id for r in VLLM_RULES + SGLANG_RULES + LLAMACPP_CONVERTER_RULES)


@pytest.mark.parametrize("rule", sorted(BREAKERS))
def test_a_broken_rule_is_one_line_naming_it_and_its_source(tmp_path, rule):
    make, engine = BREAKERS[rule]
    raw, shapes, dtypes = make()
    lines = check_head(write(tmp_path / "h", raw, shapes, dtypes), engine)
    mine = [line for line in lines if line.startswith(rule + ": ")]
    assert len(mine) == 1 and "\n" not in mine[0]
    version = {"vllm": "vllm-project/vllm v0.3", "sglang": "sgl-project/sglang v0.5.23",
               "llama.cpp": "ggml-org/llama.cpp 0c1e570"}[engine]
    assert mine[0].endswith(")") and version in mine[0] and (".py:" in mine[0] or ".cpp:" in mine[0])


# -- our exports ----------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def target():
    return tiny_target(dtype=torch.float32)


def _head(target, **kw) -> EagleHead:
    torch.manual_seed(0)
    head = make_head(HeadConfig.for_target(target, **kw)).attach(target)
    if kw.get("draft_vocab_size"):
        head.set_draft_vocab(torch.arange(0, 2 * kw["draft_vocab_size"], 2))
    return head


def test_our_eagle3_export_passes_every_loader_and_reads_back_the_same_layers(target, tmp_path):
    head = _head(target, head_type="eagle3", feature_layer_ids=[1, 2, 3], draft_vocab_size=40, fc_bias=False)
    export_published(head, tmp_path / "x")
    for engine in ("vllm", "sglang", "llama.cpp"):
        assert check_head(tmp_path / "x", engine) == [], engine
    raw = json.loads((tmp_path / "x/config.json").read_text())
    assert raw["eagle_aux_hidden_state_layer_ids"] == [1, 2, 3]  # layer inputs (vLLM, llama.cpp)
    assert raw["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [0, 1, 2]  # layer outputs (SGLang)
    assert EagleHead.from_pretrained(tmp_path / "x").config.feature_layer_ids == [1, 2, 3]
    del raw["eagle_aux_hidden_state_layer_ids"]  # as SpecForge writes it: the nested ids alone, read as outputs
    (tmp_path / "x/config.json").write_text(json.dumps(raw))
    assert EagleHead.from_pretrained(tmp_path / "x").config.feature_layer_ids == [1, 2, 3]


@pytest.mark.parametrize("fc_bias", [True, False])
def test_our_eagle1_export_for_each_server(target, tmp_path, fc_bias, capsys):
    head = _head(target, fc_bias=fc_bias)
    head.save_pretrained(tmp_path / "ours")
    for engine in ("vllm", "sglang"):
        out = tmp_path / f"for-{engine}"
        argv = ["export", "--draft", str(tmp_path / "ours"), "--out", str(out), "--for", engine]
        if engine == "vllm" and fc_bias:  # refused in one line, nothing written; written when asked for
            assert eagle_cli.main(argv) == 2
            err = capsys.readouterr().err.strip()
            assert err.startswith("eagle export: error: vllm would not run this head as trained: vllm.eagle1.fc_bias")
            assert len(err.splitlines()) == 1 and not out.exists()
            argv.append("--allow-lossy")
        assert eagle_cli.main(argv) == 0
        expected = {"vllm.eagle1.fc_bias"} if engine == "vllm" and fc_bias else set()
        assert broken(out, engine) == expected
    if not fc_bias:  # SGLang's fc always has a bias: written as zeros, the head computes the same
        again = EagleHead.from_pretrained(tmp_path / "for-sglang").attach(target)
        x = torch.randn(1, 5, target.hidden_size)
        pos = torch.arange(5)[None]
        ids = torch.randint(0, 90, (1, 5))
        torch.testing.assert_close(again(x, ids, pos), head(x, ids, pos))


def test_the_cli_says_ok_or_each_broken_rule_and_refuses_what_it_cannot_read(tmp_path, capsys):
    write(tmp_path / "good", *yuhuili_eagle3())
    assert eagle_cli.main(["check", str(tmp_path / "good"), "--for", "vllm"]) == 0
    assert capsys.readouterr().out.strip().endswith("ok against 10 rules of vllm's loader")
    raw, shapes = specforge()
    write(tmp_path / "sf", raw, shapes)
    assert eagle_cli.main(["check", str(tmp_path / "sf"), "--for", "vllm"]) == 1
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[0].startswith("vllm.eagle3.aux_layer_ids: the fused layers are only in eagle_config.")
    assert lines[-1].endswith("1 broken against 10 rules of vllm's loader")
    assert eagle_cli.main(["check", str(tmp_path / "nothing"), "--for", "sglang"]) == 2
    assert capsys.readouterr().err.strip() == (f"eagle check: error: head '{tmp_path / 'nothing'}': no config.json "
                                              "(name a published-layout directory or a .gguf)")


# -- a llama.cpp draft GGUF -----------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def draft_gguf(tmp_path_factory):
    pytest.importorskip("gguf")
    from test_llamacpp_export import smollm2_shaped

    from eagle.llamacpp import export_llamacpp
    from eagle.target import resolve_target

    path = tmp_path_factory.mktemp("gguf") / "d.gguf"
    export_llamacpp(smollm2_shaped(), path, resolve_target("smollm2-135m"))
    return path


GGUF_BREAKERS = {
    "llama.cpp.arch": lambda h: h.raw.update({"general.architecture": "llama"}),
    "llama.cpp.target_layers": lambda h: h.raw.update({"eagle3.target_layers": [2, 15]}),
    "llama.cpp.target_hidden_size": lambda h: h.raw.pop("eagle3.target_hidden_size"),
    "llama.cpp.one_layer": lambda h: h.raw.update({"eagle3.block_count": 2}),
    "llama.cpp.tensors": lambda h: h.tensors.pop("blk.0.attn_norm_2.weight"),
    "llama.cpp.d2t": lambda h: h.d2t.__setitem__(1, h.d2t[0]),
    "llama.cpp.norm_before_fc": lambda h: h.raw.update({"eagle3.norm_before_fc": True}),
    "llama.cpp.tokenizer": lambda h: h.raw.pop("tokenizer.ggml.model"),
}


def test_our_draft_gguf_passes_and_each_gguf_rule_has_a_breaker(draft_gguf, monkeypatch):
    import eagle.contracts as contracts

    assert check_head(draft_gguf, "llama.cpp") == []
    assert sorted(GGUF_BREAKERS) == sorted(r.id for r in LLAMACPP_GGUF_RULES)
    good = read_head(draft_gguf)
    for rule, brk in GGUF_BREAKERS.items():
        h = copy.deepcopy(good)
        brk(h)
        monkeypatch.setattr(contracts, "read_head", lambda path, h=h: h)
        lines = check_head(draft_gguf, "llama.cpp")
        assert [line.split(":")[0] for line in lines] == [rule], (rule, lines)
        assert "ggml-org/llama.cpp 0c1e570" in lines[0] and "\n" not in lines[0]
