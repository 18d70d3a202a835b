"""Heads in the published EAGLE layouts: export and load back bit for bit, read hand-made published checkpoints
(safetensors and pytorch_model.bin), and name what is wrong with one that does not fit."""

import json

import pytest
import torch
from safetensors.torch import load_file
from test_eagle3 import eagle3_head
from tiny import tiny_head, tiny_target

from eagle import CheckpointError, EagleHead
from eagle.head import eagle3_layers
from eagle.interop import ExportError, export_published
from infer import SpeculativeDecoder

PROMPT = [5, 9, 14, 22, 7, 31, 3]


@pytest.fixture(scope="module")
def target():
    return tiny_target()


def _same_state(a: EagleHead, b: EagleHead) -> None:
    sa, sb = a.trainable_state_dict(), b.trainable_state_dict()
    assert sa.keys() == sb.keys()
    for k in sa:
        assert torch.equal(sa[k].to(sb[k].dtype), sb[k]), k


def test_eagle1_export_has_the_published_keys_and_loads_back_exactly(target, tmp_path):
    head = tiny_head(target)
    assert head.config.fc_bias
    with pytest.raises(ExportError, match=r"^vllm would not run this head as trained: vllm.eagle1.fc_bias: fc.bias is "
                                          r"dropped by vLLM .*\(pass --allow-lossy to write it anyway\)$"):
        export_published(head, tmp_path / "x")
    assert not (tmp_path / "x").exists()  # nothing written
    lost = export_published(head, tmp_path / "x", allow_lossy=True)
    assert [line.split(":")[0] for line in lost] == ["vllm.eagle1.fc_bias"]
    raw = json.loads((tmp_path / "x/config.json").read_text())
    # no `bias` key: vLLM would read it as the attention bias (uninitialized q/k/v/o biases)
    assert raw["architectures"] == ["LlamaForCausalLM"] and "bias" not in raw and raw["num_hidden_layers"] == 1
    keys = set(load_file(str(tmp_path / "x/model.safetensors")))
    assert {"fc.weight", "fc.bias", "layers.0.self_attn.q_proj.weight", "layers.0.mlp.down_proj.weight",
            "layers.0.post_attention_layernorm.weight"} <= keys
    assert not any("input_layernorm" in k for k in keys)  # EAGLE's first layer has none
    from eagle.contracts import check_head

    assert [line.split(":")[0] for line in check_head(tmp_path / "x", "vllm")] == ["vllm.eagle1.fc_bias"]
    assert check_head(tmp_path / "x", "sglang")[0].startswith("sglang.architectures")  # made for vLLM
    again = EagleHead.from_pretrained(tmp_path / "x", dtype=torch.float64).attach(target)
    _same_state(head, again)
    a = SpeculativeDecoder(target, head).generate(PROMPT, 24, num_speculative_tokens=3)
    b = SpeculativeDecoder(target, again).generate(PROMPT, 24, num_speculative_tokens=3)
    assert a.token_ids == b.token_ids and a.accept_lengths == b.accept_lengths


def test_eagle3_export_keeps_the_draft_vocabulary_as_offsets_and_loads_back_exactly(target, tmp_path):
    head = eagle3_head(target)
    export_published(head, tmp_path / "x")
    raw = json.loads((tmp_path / "x/config.json").read_text())
    assert raw["architectures"] == ["LlamaForCausalLMEagle3"] and raw["draft_vocab_size"] == 40
    assert raw["eagle_aux_hidden_state_layer_ids"] == [0, 1, 2]  # hidden_states indices, as vLLM reads them
    assert raw["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [-1, 0, 1]  # layer outputs, as SGLang does
    w = load_file(str(tmp_path / "x/model.safetensors"))
    assert "midlayer.hidden_norm.weight" in w and "lm_head.weight" in w and "norm.weight" in w
    assert torch.equal(w["d2t"] + torch.arange(40), head.d2t) and w["t2d"].dtype == torch.bool
    assert torch.equal(w["t2d"], head.t2d)
    again = EagleHead.from_pretrained(tmp_path / "x", dtype=torch.float64).attach(target)
    _same_state(head, again)
    a = SpeculativeDecoder(target, head).generate(PROMPT, 24, mode="dynamic")
    b = SpeculativeDecoder(target, again).generate(PROMPT, 24, mode="dynamic")
    assert a.token_ids == b.token_ids and a.accept_lengths == b.accept_lengths


def _published_eagle1(head: EagleHead, path, bin_file: bool) -> None:
    """An EAGLE-1 head as the EAGLE repository saves it: a Llama config, its own copy of the embedding, layer 0
    without an input norm, a rotary buffer of older transformers."""
    c = head.config
    path.mkdir()
    (path / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "bias": True, "hidden_size": c.hidden_size,
        "intermediate_size": c.intermediate_size, "num_attention_heads": c.num_attention_heads,
        "num_key_value_heads": c.num_key_value_heads, "num_hidden_layers": 1, "rms_norm_eps": c.rms_norm_eps,
        "vocab_size": c.vocab_size, "rope_theta": c.rope_theta}))
    state = {k: v.float() for k, v in head.trainable_state_dict().items()}
    state["embed_tokens.weight"] = torch.zeros(c.vocab_size, c.hidden_size)
    state["layers.0.self_attn.rotary_emb.inv_freq"] = torch.zeros(c.head_dim // 2)
    if bin_file:
        torch.save(state, path / "pytorch_model.bin")
    else:
        from safetensors.torch import save_file

        save_file(state, str(path / "model.safetensors"))


@pytest.mark.parametrize("bin_file", [True, False])
def test_a_published_eagle1_checkpoint_loads_and_decodes_losslessly(target, tmp_path, bin_file):
    head = tiny_head(target)
    _published_eagle1(head, tmp_path / "pub", bin_file)
    loaded = EagleHead.from_pretrained(tmp_path / "pub", dtype=torch.float64).attach(target)
    _same_state(head, loaded)
    base = SpeculativeDecoder(target, None).generate(PROMPT, 24, speculative=False)
    assert SpeculativeDecoder(target, loaded).generate(PROMPT, 24).token_ids == base.token_ids


def test_a_published_checkpoint_that_does_not_fit_names_every_problem(target, tmp_path):
    head = tiny_head(target)
    _published_eagle1(head, tmp_path / "pub", bin_file=False)
    from safetensors.torch import save_file

    w = load_file(str(tmp_path / "pub/model.safetensors"))
    del w["layers.0.mlp.up_proj.weight"]
    w["fc.weight"] = w["fc.weight"][:, :-1].contiguous()
    save_file(w, str(tmp_path / "pub/model.safetensors"))
    with pytest.raises(CheckpointError) as e:
        EagleHead.from_pretrained(tmp_path / "pub")
    msg = str(e.value)
    assert "\n" not in msg and "missing: layers.0.mlp.up_proj.weight" in msg and "wrong shape: fc.weight" in msg


def test_an_eagle3_checkpoint_without_feature_layers_needs_its_target(target, tmp_path):
    head = eagle3_head(target)
    export_published(head, tmp_path / "x")
    raw = json.loads((tmp_path / "x/config.json").read_text())
    del raw["eagle_config"], raw["eagle_aux_hidden_state_layer_ids"]
    (tmp_path / "x/config.json").write_text(json.dumps(raw))
    with pytest.raises(CheckpointError, match="eagle_aux_hidden_state_layer_ids") as e:
        EagleHead.from_pretrained(tmp_path / "x")
    assert "\n" not in str(e.value)
    loaded = EagleHead.from_pretrained(tmp_path / "x", target=target)
    assert loaded.config.feature_layer_ids == eagle3_layers(target.config.num_hidden_layers)


def test_export_cli_writes_the_layout(target, tmp_path, capsys):
    from eagle_cli import main

    tiny_head(target).save_pretrained(tmp_path / "ours")  # with an fc bias, which SGLang keeps
    assert main(["export", "--draft", str(tmp_path / "ours"), "--out", str(tmp_path / "pub"), "--for", "sglang"]) == 0
    assert (tmp_path / "pub/model.safetensors").exists() and "published EAGLE layout" in capsys.readouterr().out
    assert main(["export", "--draft", str(tmp_path / "nothing"), "--out", str(tmp_path / "p2")]) == 2
    (tmp_path / "run").mkdir()
    (tmp_path / "run/log.jsonl").write_text("{}")
    assert main(["export", "--draft", str(tmp_path / "ours"), "--out", str(tmp_path / "run"), "--for", "sglang"]) == 2
    assert (tmp_path / "run/log.jsonl").exists() and "not a head directory" in capsys.readouterr().err
    assert main(["export", "--draft", str(tmp_path / "ours"), "--out", str(tmp_path / "pub"), "--for", "sglang"]) == 0


def test_speculators_export_is_what_vllm_builds_and_loads_back_exactly(target, tmp_path, capsys):
    """The speculators format (vLLM's `SpeculatorsConfig`): an EAGLE-3 head, its layer config nested, the residual
    raw (vLLM's speculators default is the normed one), EAGLE-3.1's keys where the head has them."""
    from eagle.contracts import check_head
    from eagle_cli import main

    head = eagle3_head(target, fc_norm=True, norm_output=True)
    head.save_pretrained(tmp_path / "ours")
    assert main(["export", "--draft", str(tmp_path / "ours"), "--out", str(tmp_path / "spec"),
                 "--format", "speculators", "--target", "org/verifier"]) == 0
    raw = json.loads((tmp_path / "spec/config.json").read_text())
    assert raw["speculators_model_type"] == "eagle3" and raw["transformer_layer_config"]["num_hidden_layers"] == 1
    assert raw["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 3
    assert raw["speculators_config"]["verifier"]["name_or_path"] == "org/verifier"
    assert raw["norm_before_residual"] is False and raw["fc_norm"] is True and raw["norm_output"] is True
    assert raw["eagle_aux_hidden_state_layer_ids"] == [0, 1, 2] and raw["draft_vocab_size"] == 40
    w = load_file(str(tmp_path / "spec/model.safetensors"))
    assert {"fc_norm.0.weight", "fc_norm.2.weight", "layers.0.hidden_norm.weight", "lm_head.weight", "d2t"} <= set(w)
    assert check_head(tmp_path / "spec", "vllm") == []
    again = EagleHead.from_pretrained(tmp_path / "spec", dtype=torch.float64).attach(target)
    assert again.config.fc_norm and again.config.norm_output
    _same_state(head, again)
    # an EAGLE-1 head has no speculators type vLLM loads: one line, nothing written
    tiny_head(target).save_pretrained(tmp_path / "e1")
    assert main(["export", "--draft", str(tmp_path / "e1"), "--out", str(tmp_path / "x"), "--format",
                 "speculators"]) == 2
    assert "EAGLE-3 heads" in capsys.readouterr().err and not (tmp_path / "x").exists()
    # a speculators head with vLLM's default residual (normed) is not what this project computes
    raw.pop("norm_before_residual")
    (tmp_path / "spec/config.json").write_text(json.dumps(raw))
    with pytest.raises(CheckpointError, match="norm_before_residual true"):
        EagleHead.from_pretrained(tmp_path / "spec")


def test_a_config_bias_key_is_refused_for_vllm(target, tmp_path):
    """The EAGLE repo's `bias: true` (its fc bias) is vLLM's attention bias: a head carrying it loads with q/k/v/o
    biases nothing fills. `eagle check` names it."""
    from eagle.contracts import check_head

    export_published(eagle3_head(target), tmp_path / "x")
    raw = json.loads((tmp_path / "x/config.json").read_text())
    (tmp_path / "x/config.json").write_text(json.dumps({**raw, "bias": True}))
    lines = check_head(tmp_path / "x", "vllm")
    assert len(lines) == 1 and lines[0].startswith("vllm.config_bias: config.json has bias: true: vLLM builds")


def test_an_eagle31_head_is_refused_where_the_engine_would_drop_its_norms(target, tmp_path):
    head = eagle3_head(target, fc_norm=True, norm_output=True)
    assert export_published(head, tmp_path / "v") == []  # vLLM reads fc_norm and norm_output
    with pytest.raises(ExportError, match=r"^sglang would not run this head as trained: fc_norm / norm_output"):
        export_published(head, tmp_path / "s", "sglang")
    assert not (tmp_path / "s").exists()
