"""`eagle export --format llama.cpp`: an EAGLE-3 head as llama.cpp's EAGLE3 draft GGUF, read back with the `gguf`
package: llama.cpp's names, shapes and types, q / k rows in its rotary layout, d2t as absolute target ids, the
target's tokenizer; and one-line refusals for what llama.cpp cannot run. (That llama.cpp's own converter makes the
same tensors of our published export, and that llama.cpp decodes with the file, is benchmarks/peers.py's
`--check-export`: it needs the llama.cpp build.)"""

import numpy as np
import pytest
import torch

import eagle_cli
from eagle.head import make_head
from eagle.head_config import HeadConfig
from eagle.llamacpp import ExportError, _permute
from eagle.target import resolve_target

gguf = pytest.importorskip("gguf")


SHAPES = {  # the embedded targets' shapes: hidden, vocabulary, heads, kv heads, head dim, MLP, layers fused
    "smollm2-135m": (576, 49152, 9, 3, 64, 1536, [2, 15, 27]),
    "gemma3-270m": (640, 262144, 4, 1, 256, 2048, [2, 9, 15]),
}


def smollm2_shaped(head_type="eagle3", target="smollm2-135m"):
    """A random head with an embedded target's shapes (no target weights needed), a draft vocabulary of 512 ids."""
    H, V, heads, kv, dim, inter, layers = SHAPES[target]
    cfg = HeadConfig(head_type=head_type, hidden_size=H, vocab_size=V, num_attention_heads=heads,
                     num_key_value_heads=kv, head_dim=dim, intermediate_size=inter, rms_norm_eps=1e-5,
                     rope_theta=100000.0, fc_bias=False, target=target, draft_vocab_size=512,
                     feature_layer_ids=layers if head_type == "eagle3" else [-1])
    torch.manual_seed(0)
    head = make_head(cfg)
    for p in head.parameters():
        torch.nn.init.normal_(p, std=0.02)
    head.set_draft_vocab(torch.randperm(V, generator=torch.Generator().manual_seed(1))[:512].sort().values)
    return head


@pytest.mark.parametrize("name", ["smollm2-135m", "gemma3-270m"])
def test_the_draft_gguf_holds_what_llamacpp_reads(tmp_path, name, capsys):
    H, V, heads, kv, dim, inter, layers = SHAPES[name]
    head = smollm2_shaped(target=name)
    head.save_pretrained(tmp_path / "head")
    eagle_cli.main(["export", "--draft", str(tmp_path / "head"), "--out", str(tmp_path / "d.gguf"),
                    "--format", "llama.cpp"])
    # llama.cpp's Gemma-3 graph extracts no layer inputs: the export says so
    assert ("does not record its layer inputs" in capsys.readouterr().out) == (name == "gemma3-270m")
    r = gguf.GGUFReader(tmp_path / "d.gguf")
    field = lambda k: r.fields[k].parts[r.fields[k].data[0]].tolist()[0]  # noqa: E731
    assert bytes(r.fields["general.architecture"].parts[-1]).decode() == "eagle3"
    assert [r.fields["eagle3.target_layers"].parts[i].tolist()[0] for i in r.fields["eagle3.target_layers"].data] \
        == layers
    assert field("eagle3.target_hidden_size") == H and field("eagle3.block_count") == 1
    assert field("eagle3.attention.head_count_kv") == kv and field("eagle3.feed_forward_length") == inter
    assert field("eagle3.attention.key_length") == dim and field("eagle3.norm_before_residual") is False
    # the target's tokenizer, token for token
    target = gguf.GGUFReader(resolve_target(name))
    toks = lambda rd: [bytes(rd.fields["tokenizer.ggml.tokens"].parts[i]) for i in rd.fields["tokenizer.ggml.tokens"].data]  # noqa: E731,E501
    assert toks(r) == toks(target)
    assert field("tokenizer.ggml.eos_token_id") == target.fields["tokenizer.ggml.eos_token_id"].parts[-1].tolist()[0]
    assert sorted(k for k in r.fields if k.startswith("tokenizer.")) == \
        sorted(k for k in target.fields if k.startswith("tokenizer."))
    tensors = {t.name: t for t in r.tensors}
    assert sorted(tensors) == sorted(
        ["fc.weight", "output_norm.weight", "output.weight", "d2t"]
        + [f"blk.0.{n}.weight" for n in ("attn_norm", "attn_norm_2", "attn_q", "attn_k", "attn_v", "attn_output",
                                         "ffn_norm", "ffn_gate", "ffn_up", "ffn_down")])
    kind = {n: t.tensor_type.name for n, t in tensors.items()}
    assert kind["fc.weight"] == kind["output.weight"] == kind["blk.0.attn_q.weight"] == "F16"
    assert kind["blk.0.attn_norm_2.weight"] == kind["output_norm.weight"] == "F32" and kind["d2t"] == "I64"
    # GGUF lists dimensions innermost first: fc is {3H, H}, output {H, Vd}
    assert list(tensors["fc.weight"].shape) == [3 * H, H] and list(tensors["output.weight"].shape) == [H, 512]
    assert np.array_equal(np.asarray(tensors["d2t"].data), head.d2t.numpy())
    q = torch.from_numpy(np.asarray(tensors["blk.0.attn_q.weight"].data).astype(np.float32)).view(heads * dim, 2 * H)
    k = torch.from_numpy(np.asarray(tensors["blk.0.attn_k.weight"].data).astype(np.float32)).view(kv * dim, 2 * H)
    attn = head.layers[0].self_attn
    torch.testing.assert_close(q, _permute(attn.q_proj.weight.detach(), heads).half().float(), rtol=0, atol=0)
    torch.testing.assert_close(k, _permute(attn.k_proj.weight.detach(), kv).half().float(), rtol=0, atol=0)
    norm = torch.from_numpy(np.asarray(tensors["blk.0.attn_norm_2.weight"].data).copy())
    assert torch.equal(norm, head.layers[0].hidden_norm.weight.detach())


def test_the_rotary_permutation_pairs_the_halves():
    w = torch.arange(8.0)[:, None]  # one head of 8 rows: halves (0..3), (4..7) -> pairs (0, 4), (1, 5), ...
    assert _permute(w, 1).flatten().tolist() == [0, 4, 1, 5, 2, 6, 3, 7]


def test_what_llamacpp_cannot_run_is_refused_in_one_line(tmp_path, capsys):
    e1 = smollm2_shaped("eagle1")
    e1.save_pretrained(tmp_path / "e1")
    assert eagle_cli.main(["export", "--draft", str(tmp_path / "e1"), "--out", str(tmp_path / "x.gguf"),
                           "--format", "llama.cpp"]) == 2
    assert capsys.readouterr().err.strip() == (
        "eagle export: error: head_type eagle1: llama.cpp has no EAGLE-1/2 draft type (its drafts are draft-eagle3, a "
        "draft model, or n-grams); train an EAGLE-3 head (configs/smollm2-135m-eagle3.yaml) for llama.cpp, or "
        "export this one for vLLM / SGLang")
    e3 = smollm2_shaped()
    e3.save_pretrained(tmp_path / "e3")
    (tmp_path / "notes.gguf").write_text("mine")
    for extra, said in ((["--out", str(tmp_path / "notes.gguf")], "exists and is not an EAGLE3 draft GGUF"),
                        (["--out", str(tmp_path / "x.bin")], "name a .gguf file for llama.cpp"),
                        (["--out", str(tmp_path / "x.gguf"), "--target-gguf", str(tmp_path / "notes.gguf")],
                         "cannot be read"),
                        (["--out", str(tmp_path / "x.gguf"), "--target", str(tmp_path)],
                         "is not a GGUF file: name the target's GGUF")):
        assert eagle_cli.main(["export", "--draft", str(tmp_path / "e3"), "--format", "llama.cpp", *extra]) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith("eagle export: error: ") and said in err and "\n" not in err
    assert (tmp_path / "notes.gguf").read_text() == "mine" and not (tmp_path / "x.gguf").exists()
    with pytest.raises(ExportError, match=r"^fc_norm and norm_output \(EAGLE-3.1\): llama.cpp 0c1e570's EAGLE3"):
        from eagle.llamacpp import check
        check(HeadConfig(**{**vars(e3.config), "fc_norm": True, "norm_output": True}), tmp_path / "z.gguf", "f16")
    with pytest.raises(ExportError, match="has 49152 tokens but the head was made for a vocabulary of 100"):
        from eagle.llamacpp import export_llamacpp
        export_llamacpp(make_head(HeadConfig(**{**vars(e3.config), "vocab_size": 100, "draft_vocab_size": 0})),
                        tmp_path / "y.gguf", resolve_target("smollm2-135m"))
