"""Tiny random targets for unit tests: a Llama of a few layers and an offline word-level tokenizer."""

from __future__ import annotations

import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from eagle import EagleHead, HeadConfig, TargetModel

CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def tiny_tokenizer(vocab_size: int = 96) -> PreTrainedTokenizerFast:
    special = ["<unk>", "<pad>", "<|im_start|>", "<|im_end|>"]
    words = [f"w{i}" for i in range(vocab_size - len(special) - 4)] + ["user", "assistant", "system", "\n"]
    vocab = {t: i for i, t in enumerate(special + words)}
    tk = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, unk_token="<unk>", pad_token="<pad>", eos_token="<|im_end|>",
                                  additional_special_tokens=["<|im_start|>"])
    tok.chat_template = CHATML
    return tok


def tiny_target(vocab_size: int = 96, layers: int = 2, hidden: int = 32, dtype=torch.float64, seed: int = 0,
                attn: str = "sdpa") -> TargetModel:
    torch.manual_seed(seed)
    tok = tiny_tokenizer(vocab_size)
    cfg = LlamaConfig(vocab_size=vocab_size, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                      eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, tie_word_embeddings=False)
    cfg._attn_implementation = attn
    model = LlamaForCausalLM(cfg).to(dtype).eval().requires_grad_(False)
    # Sharpen the output distribution so greedy continuations are not near-ties everywhere.
    model.lm_head.weight.mul_(8.0)
    return TargetModel(name="tiny-llama", model=model, tokenizer=tok)


def tiny_head(target: TargetModel, seed: int = 1, num_layers: int = 1) -> EagleHead:
    torch.manual_seed(seed)
    return EagleHead(HeadConfig.for_target(target, num_layers=num_layers)).to(target.dtype).attach(target)
