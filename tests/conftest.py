"""Shared test fixtures: a tiny tokenizer built offline, with a one-line ChatML chat template; the CPU backend's
paths (`kernel_path`); the tests' own cache folder."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # import the packages from the checkout
# The tests keep their own cache (converted targets, kernels, timing plans), apart from the user's ~/.cache/eagle:
# plans measured under a test's forced settings must not reach real runs. EAGLE_TEST_CACHE names another folder.
os.environ["EAGLE_CACHE"] = os.environ.get("EAGLE_TEST_CACHE") or str(ROOT / ".cache" / "eagle-tests")

from paths import KERNEL_PATHS, force_switches, kernel_path_missing  # noqa: E402 (after the cache folder is set)

SPECIAL_TOKENS = ["<pad>", "<|im_start|>", "<|im_end|>", "<bos>", "<eos>", "<start_of_turn>", "<end_of_turn>"]

CHATML_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

_CORPUS = """\
The quick brown fox jumps over the lazy dog. Hello there, how are you today? I am fine, thank you.
What is the capital of France? The capital of France is Paris. Two plus two is four.
user assistant system model Please write a short poem about the sea. Waves roll in and out again.
def add(a, b): return a + b  # numbers 0 1 2 3 4 5 6 7 8 9 and some punctuation: ; ! ? ( ) [ ] { }
"""


def _build_tokenizer_json() -> str:
    """Train a byte-level BPE of about 300 tokens on a few lines; byte-level so any text round-trips."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=SPECIAL_TOKENS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(_CORPUS.splitlines(), trainer=trainer)
    return tok.to_str()


@pytest.fixture(scope="session")
def tokenizer_json() -> str:
    return _build_tokenizer_json()


@pytest.fixture(scope="session")
def make_tokenizer(tokenizer_json):
    """make_tokenizer(chat_template, eos_token="<|im_end|>", bos_token=None): a fresh PreTrainedTokenizerFast."""
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    def make(chat_template: str | None = CHATML_TEMPLATE, eos_token: str = "<|im_end|>", bos_token: str | None = None):
        tok = PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(tokenizer_json), eos_token=eos_token,
                                      bos_token=bos_token, pad_token="<pad>", name_or_path="tiny-bpe")
        tok.chat_template = chat_template
        return tok

    return make


@pytest.fixture(scope="session")
def tiny_tokenizer(make_tokenizer):
    """About 300 tokens, ChatML template, eos = <|im_end|>, pad = <pad>; offsets work (fast tokenizer)."""
    return make_tokenizer()


# -- the CPU backend's paths (tests/paths.py) --------------------------------------------------------------------
@pytest.fixture(scope="session")
def avx2_library():
    """The kernel built for AVX2 alone (x86-64-v3), once per test session (kept in the tests' cache)."""
    from cpu_backend import kernels, toolchain
    from eagle.target import cache_root

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(toolchain, "FLAGS", [f if f != "-march=native" else "-march=x86-64-v3" for f in toolchain.FLAGS])
        path = cache_root() / "kernels" / f"avx2-{toolchain.library_key()}.so"
        try:
            lib = kernels.load(path)
        except OSError:
            toolchain.compile_library(path)
            lib = kernels.load(path)
    assert not lib.vq_supported() and not lib.amx_enable()
    return lib


@pytest.fixture(params=KERNEL_PATHS)
def kernel_path(request, monkeypatch) -> str:
    """Runs the test once per CPU path (tests/paths.py), that path forced; returns its name."""
    from cpu_backend import kernels

    path = request.param
    reason = kernel_path_missing(path)
    if reason:
        pytest.skip(f"{path} path: {reason}")
    if path == "avx2":
        monkeypatch.setattr(kernels, "_lib", request.getfixturevalue("avx2_library"))
        monkeypatch.setattr(kernels, "_amx", None)  # asked of that library again
    force_switches(monkeypatch, amx=path == "amx")
    force_switches(monkeypatch, vnni=path == "vnni")
    return path
