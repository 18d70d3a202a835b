"""Device and precision: `--device` / `--dtype` everywhere, one-line errors for what this machine cannot do, the CPU
backend only on the CPU in float32, 16-bit decoding against a reference in the same precision, and the GPU check's
CPU form (benchmarks/gpu_check.py --device cpu --tiny)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from tiny import tiny_head, tiny_target

import cpu_backend
from eagle.device import DeviceError, resolve_device, resolve_dtype
from eagle_cli import main
from infer import SpeculativeDecoder
from infer.evaluate import EvalConfig, evaluate
from infer.reference import HFReference

ROOT = Path(__file__).resolve().parents[1]


def test_devices_and_dtypes_resolve_or_say_why():
    assert resolve_device("cpu") == torch.device("cpu")
    assert resolve_device("auto") == torch.device("cuda" if torch.cuda.is_available() else "cpu")
    assert resolve_dtype("bf16") == resolve_dtype("bfloat16") == torch.bfloat16
    assert resolve_dtype(torch.float16) == torch.float16
    with pytest.raises(DeviceError, match="device 'gpu7': expected auto, cpu, cuda or cuda:N"):
        resolve_device("gpu7")
    with pytest.raises(DeviceError, match="dtype 'int8': expected auto or one of float32, bfloat16, float16"):
        resolve_dtype("int8")
    if not torch.cuda.is_available():
        with pytest.raises(DeviceError, match="device 'cuda': no CUDA device here"):
            resolve_device("cuda")


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_commands_refuse_a_device_this_machine_lacks(capsys, tmp_path):
    for argv in (["generate", "--target", "smollm2-135m", "--prompt", "hi", "--device", "cuda"],
                 ["eval", "--target", "smollm2-135m", "--data", str(tmp_path / "p.jsonl"), "--device", "cuda:1"],
                 ["train", f"run_dir={tmp_path / 'run'}", f"out={tmp_path / 'head'}", "budget.max_steps=1",
                  "device=cuda"]):
        assert main(argv) == 2
        assert "no CUDA device here" in capsys.readouterr().err.strip().splitlines()[-1]


def test_the_cpu_backend_is_only_for_float32_on_the_cpu():
    t = tiny_target(dtype=torch.float32)
    assert cpu_backend.applies(t.model)
    assert not cpu_backend.applies(t.model.to(torch.bfloat16)) and not cpu_backend.applies(t.model.double())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_16_bit_decoding_is_checked_against_the_targets_own_16_bit_greedy(tmp_path, dtype):
    # plain torch in 16 bits (the backend stays off); eval reports the exact-match rate against transformers' greedy
    # decoding in the same precision and, for each mismatch, where and the reference's top-2 logit margin there
    engine, ref = tiny_target(dtype=dtype), HFReference(tiny_target(dtype=dtype))
    dec = SpeculativeDecoder(engine, tiny_head(engine))
    f = tmp_path / "p.jsonl"
    f.write_text("\n".join(json.dumps({"turns": [f"w{i} w{i + 1} w{2 * i}"]}) for i in range(4)))
    r = evaluate(EvalConfig(data=str(f), out=str(tmp_path / "ev"), num_prompts=4, reference="hf", warmup=0),
                 decoder=dec, reference=ref)
    assert not cpu_backend.enabled(engine.model)
    assert 0.0 <= r["lossless_vs_reference"] <= 1.0 and r["baseline_vs_reference"] is not None
    for p in r["prompts"]:
        m = p["spec_mismatch"]
        assert m is None or (m["position"] >= 0 and (m["margin"] is None or m["margin"] >= 0))


def test_a_head_and_a_decoder_load_in_the_precision_asked(tmp_path):
    t = tiny_target(dtype=torch.float32)
    tiny_head(t).float().save_pretrained(tmp_path / "head")
    t.model.save_pretrained(tmp_path / "target")
    t.tokenizer.save_pretrained(tmp_path / "target")
    dec = SpeculativeDecoder.from_pretrained(str(tmp_path / "target"), str(tmp_path / "head"), device="cpu",
                                             dtype="bfloat16")
    assert dec.target.dtype == torch.bfloat16 and next(dec.head.parameters()).dtype == torch.bfloat16
    assert dec.head.d2t.dtype == torch.long if dec.head.config.draft_vocab_size else True
    out = dec.generate([5, 9, 14], 8, num_speculative_tokens=2)
    assert len(out.token_ids) == 8


def test_training_in_bf16_weights_and_in_bf16_autocast_runs_and_validates(tmp_path):
    # the batches, features and head on one device and dtype, losses in float32, validation included
    from test_train import config, write_prepared

    from train.loop import train

    target = tiny_target(dtype=torch.float32)
    write_prepared(tmp_path / "data", target)
    state = train(config(tmp_path, "budget.max_steps=3", "mixed_precision=bf16", "data.feature_dtype=bfloat16",
                         "device=cpu"), target=target)
    assert state.step == 3 and state.best_tau >= 1.0
    low = tiny_target(dtype=torch.bfloat16)
    state = train(config(tmp_path, "budget.max_steps=3", "model.dtype=bfloat16", f"run_dir={tmp_path / 'run16'}",
                         f"out={tmp_path / 'head16'}"), target=low)
    assert state.step == 3 and state.best_tau >= 1.0


def test_the_gpu_check_runs_on_the_cpu_in_its_tiny_form():
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_check.py"), "--device", "cpu", "--tiny"],
                          capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["device"] == "cpu" and report["rows_kept"] > 0
    for kind in ("eagle1", "eagle3"):
        assert report["train"][kind]["steps"] > 0 and report["train"][kind]["tokens_per_s"] > 0
    fp32, bf16 = report["decode"]["float32"], report["decode"]["bfloat16"]
    for setting in ("plain", "eagle1_chain3", "eagle1_dynamic_4_3_8", "eagle3_chain3", "eagle3_dynamic_4_3_8"):
        assert fp32[setting]["exact_match"] == 1.0  # float32: transformers' own greedy tokens
        assert 0.0 <= bf16[setting]["exact_match"] <= 1.0 and bf16[setting]["tokens_per_s"] > 0
        if setting != "plain":
            assert fp32[setting]["tau"] >= 1.0
