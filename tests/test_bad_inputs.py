"""Bad input ends in one line naming the input and what is wrong, and loses nothing already done: one test per row
of docs/bad-inputs.md, most through the command line (`eagle_cli.main`, whose errors are `eagle CMD: error: ...`
and exit status 2), on a tiny random Llama saved as a model directory. The kill tests run `eagle train` in a
subprocess and SIGKILL it: between the two renames of a checkpoint save (the EAGLE_FAULT injection point of
`train.checkpoints.save_checkpoint`) and at random instants; the resumed head must be bit for bit an uninterrupted run's."""

import json
import os
import random
import signal
import subprocess
import sys
import time
import warnings
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from test_train import config, write_prepared
from tiny import tiny_head, tiny_target

from eagle import EagleHead
from eagle.checkpoint import CheckpointError
from eagle_cli import main
from cpu_backend import CPUConfig
from infer import SpeculativeDecoder
from train.checkpoints import TrainState
from train.config import TrainError
from train.loop import train

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def target():
    return tiny_target(dtype=torch.float32)


@pytest.fixture(scope="module")
def files(tmp_path_factory, target):
    """A tiny target as a model directory (with and without a chat template), a head for it, one for another
    target, prepared training rows, and prompt files."""
    d = tmp_path_factory.mktemp("bad-inputs")
    target.model.save_pretrained(d / "tiny")
    target.tokenizer.save_pretrained(d / "tiny")
    plain = tiny_target(dtype=torch.float32)
    plain.tokenizer.chat_template = None
    plain.model.save_pretrained(d / "plain")
    plain.tokenizer.save_pretrained(d / "plain")
    tiny_head(target).float().save_pretrained(d / "head")
    tiny_head(tiny_target(vocab_size=120, hidden=48, dtype=torch.float32)).float().save_pretrained(d / "other-head")
    write_prepared(d / "data", target)
    (d / "ok.jsonl").write_text(json.dumps({"turns": ["w1 w2 w3"]}) + "\n")
    (d / "long.jsonl").write_text(json.dumps({"turns": [" ".join(["w1"] * 600)]}) + "\n")
    return d


def cli(capsys, *argv) -> tuple[int, str]:
    """(exit status, the last line written to stderr) of `eagle ARGV`."""
    capsys.readouterr()
    rc = main([str(a) for a in argv])
    err = capsys.readouterr().err.strip().splitlines()
    return rc, err[-1] if err else ""


def generate(files, *argv):
    return ("generate", "--target", files / "tiny", "--prompt", "w1 w2", "--max-new-tokens", 4, "--no-fast-path",
            *argv)


def corrupt_head(files, tmp_path, data: bytes):
    bad = tmp_path / "bad-head"
    bad.mkdir()
    (bad / "config.json").write_text((files / "head/config.json").read_text())
    (bad / "model.safetensors").write_bytes(data)
    return bad


# -- heads --------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["garbage", "truncated"])
def test_a_corrupt_safetensors_file_is_a_one_line_error(files, tmp_path, capsys, kind):
    data = (files / "head/model.safetensors").read_bytes()
    bad = corrupt_head(files, tmp_path, b"not a safetensors file" if kind == "garbage" else data[:3000])
    rc, line = cli(capsys, *generate(files, "--draft", bad))
    assert rc == 2 and line.startswith(f"eagle generate: error: draft head '{bad}': model.safetensors is not a "
                                       "readable safetensors file (Error while deserializing header")
    rc, line = cli(capsys, "export", "--draft", bad, "--out", tmp_path / "pub")
    assert rc == 2 and "model.safetensors is not a readable safetensors file" in line
    assert not (tmp_path / "pub").exists()


def test_a_head_directory_that_is_missing_or_is_not_a_head(files, tmp_path, capsys):
    rc, line = cli(capsys, *generate(files, "--draft", tmp_path / "nothing"))
    assert rc == 2 and line == (f"eagle generate: error: draft head '{tmp_path / 'nothing'}': no config.json (no "
                                "such directory)")
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes/notes.txt").write_text("mine")
    rc, line = cli(capsys, *generate(files, "--draft", tmp_path / "notes"))
    assert rc == 2 and line.endswith("no config.json (is it a head directory?)")


def test_a_head_config_with_a_value_of_the_wrong_type(files, tmp_path, capsys):
    bad = corrupt_head(files, tmp_path, (files / "head/model.safetensors").read_bytes())
    cfg = json.loads((bad / "config.json").read_text())
    (bad / "config.json").write_text(json.dumps({**cfg, "hidden_size": "big"}))
    rc, line = cli(capsys, *generate(files, "--draft", bad))
    assert rc == 2 and line == (f"eagle generate: error: draft head '{bad}': config.json: config key 'hidden_size' "
                                "must be int, got 'big'")
    (bad / "config.json").write_text(json.dumps({**cfg, "head_type": "eagle5"}))
    with pytest.raises(CheckpointError, match="head_type 'eagle5' is not eagle1 or eagle3"):
        EagleHead.from_pretrained(bad)


def test_a_head_for_another_target(files, capsys):
    rc, line = cli(capsys, *generate(files, "--draft", files / "other-head"))
    assert rc == 2 and "does not fit target" in line and "hidden size 48 vs 32, vocab size 120 vs 96" in line


# -- decoding options and prompts ---------------------------------------------------------------------------------
def test_a_prompt_longer_than_the_context(files, target, tmp_path, capsys):
    rc, line = cli(capsys, *generate(files, "--draft", files / "head", "--prompt", " ".join(["w1"] * 600)))
    assert rc == 2 and line == ("eagle generate: error: prompt of 605 tokens does not fit the target's context of "
                                "512 tokens (it must leave room for one new token)")
    # eval stops there too, instead of reporting an empty output as lossless
    rc, line = cli(capsys, "eval", "--target", files / "tiny", "--draft", files / "head", "--data",
                   files / "long.jsonl", "--out", tmp_path / "eval", "--no-fast-path")
    assert rc == 2 and line == (f"eagle eval: error: prompt 0 of '{files / 'long.jsonl'}': 605 tokens do not fit the "
                                "target's context of 512 tokens (it must leave room for one new token)")
    assert not (tmp_path / "eval/report.json").exists()
    dec = SpeculativeDecoder(target, None)
    with pytest.raises(ValueError, match="prompt of 512 tokens does not fit"):  # no room for a new token
        dec.generate([5] * 512, 4, speculative=False, cpu=CPUConfig(fast_path=False))
    assert len(dec.generate([5] * 511, 4, speculative=False, cpu=CPUConfig(fast_path=False)).token_ids) == 1


def test_max_new_tokens_below_one(files, target, tmp_path, capsys):
    rc, line = cli(capsys, *generate(files, "--draft", files / "head", "--max-new-tokens", 0))
    assert rc == 2 and line == "eagle generate: error: decoding config: max_new_tokens 0 must be at least 1"
    rc, line = cli(capsys, "eval", "--target", files / "tiny", "--draft", files / "head", "--data", files / "ok.jsonl",
                   "--out", tmp_path / "eval", "--max-new-tokens", 0)
    assert rc == 2 and line == "eagle eval: error: decoding config: max_new_tokens 0 must be at least 1"
    with pytest.raises(ValueError, match="max_new_tokens -1 must be at least 1"):
        SpeculativeDecoder(target, None).generate([5, 6], max_new_tokens=-1, speculative=False)


def test_prompt_token_ids_outside_the_vocabulary(target):
    with pytest.raises(ValueError, match=r"prompt token id 96 is outside the target's vocabulary \(0 .. 95\)"):
        SpeculativeDecoder(target, None).generate([5, 96], 4, speculative=False)


def test_a_target_without_a_chat_template_is_said_once(files, target, tmp_path, capsys):
    """chat_template auto: the raw text, with one warning per decoder; none: the raw text, silently; a file: its
    template; anything else: a one-line error before the target loads."""
    plain = SpeculativeDecoder.from_pretrained(str(files / "plain"), cpu=CPUConfig(fast_path=False))
    with pytest.warns(UserWarning, match="has no chat template: string prompts are tokenized as raw text") as said:
        plain.generate("w1 w2", 2, speculative=False)
        plain.generate("w3", 2, speculative=False)
    assert len([w for w in said if "chat template" in str(w.message)]) == 1
    assert plain.encode("w1 w2") == plain.target.tokenizer("w1 w2").input_ids
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        fresh = SpeculativeDecoder(plain.target, None)
        assert fresh.encode("w1 w2", chat_template="none") == plain.target.tokenizer("w1 w2").input_ids
    template = tmp_path / "turns.jinja"
    template.write_text("{% for m in messages %}{{ m['role'] }} {{ m['content'] }} {% endfor %}"
                        "{% if add_generation_prompt %}assistant{% endif %}")
    ids = SpeculativeDecoder(plain.target, None).encode("w1 w2", chat_template=str(template))
    assert plain.target.tokenizer.convert_ids_to_tokens(ids) == ["user", "w1", "w2", "assistant"]
    rc, line = cli(capsys, *generate(files, "--chat-template", tmp_path / "missing.jinja"))
    assert rc == 2 and line == (f"eagle generate: error: decoding config: chat_template "
                                f"'{tmp_path / 'missing.jinja'}' is not auto, none, a template file or a Jinja "
                                "template")
    (tmp_path / "broken.jinja").write_text("{% for m in messages %}{{ m['content'] }}")
    rc, line = cli(capsys, *generate(files, "--chat-template", tmp_path / "broken.jinja"))
    assert rc == 2 and line.startswith(f"eagle generate: error: chat_template '{tmp_path / 'broken.jinja'}': the "
                                       "template fails (TemplateSyntaxError: Unexpected end of template.")


def test_a_static_tree_that_is_missing_or_not_json(files, tmp_path, capsys):
    rc, line = cli(capsys, *generate(files, "--draft", files / "head", "--mode", "static", "--tree",
                                     tmp_path / "tree.json"))
    assert rc == 2 and line == (f"eagle generate: error: decoding config: tree '{tmp_path / 'tree.json'}': cannot "
                                "read it (No such file or directory)")
    (tmp_path / "tree.json").write_text("[[0], [1,")
    rc, line = cli(capsys, *generate(files, "--draft", files / "head", "--mode", "static", "--tree",
                                     tmp_path / "tree.json"))
    assert rc == 2 and "tree.json': not a JSON list of choice paths (Expecting value" in line


@pytest.mark.parametrize("flags, message", [
    (("--num-speculative-tokens", -1), "decoding config: num_speculative_tokens -1 must be at least 1"),
    (("--mode", "tree"), "decoding config: mode 'tree' is not chain, static or dynamic"),
    (("--temperature", -1), "decoding config: sampling needs temperature >= 0, 0 < top_p <= 1, sampling_top_k >= 0 "
                            "(got -1.0, 1.0, 0)"),
    (("--max-new-tokens", "many"), "config key 'max_new_tokens' must be int, got 'many'"),
    (("--draft-model", "tiny"), "give either draft (an EAGLE head) or draft_model (a small LM), not both"),
])
def test_decoding_options_that_cannot_work(files, capsys, flags, message):
    flags = [files / f if f == "tiny" else f for f in flags]
    rc, line = cli(capsys, *generate(files, "--draft", files / "head", *flags))
    assert rc == 2 and line == f"eagle generate: error: {message}"


def test_eval_prompt_file_missing(files, tmp_path, capsys):
    rc, line = cli(capsys, "eval", "--target", files / "tiny", "--data", tmp_path / "prompts.jsonl")
    assert rc == 2 and line == f"eagle eval: error: prompt file '{tmp_path / 'prompts.jsonl'}' does not exist"
    rc, line = cli(capsys, "eval", "--target", files / "tiny", "--data", tmp_path)
    assert rc == 2 and line == f"eagle eval: error: prompt file '{tmp_path}' is a directory; name a JSONL file"
    rc, line = cli(capsys, "eval", "--target", files / "tiny", "--data", files / "ok.jsonl", "--num-prompts", 0)
    assert rc == 2 and line == "eagle eval: error: num_prompts 0: expected at least 1"


def test_a_target_path_that_does_not_exist(tmp_path, capsys):
    rc, line = cli(capsys, "generate", "--target", tmp_path / "no-such-model", "--prompt", "hi")
    assert rc == 2 and line == f"eagle generate: error: target '{tmp_path / 'no-such-model'}': no such file or directory"


def test_a_corrupt_feature_cache_is_computed_again(files, target, tmp_path, capsys):
    from eagle.features import FeatureStore, features_dir, write_features

    folder = features_dir(tmp_path, "train", target)
    write_features(folder, [torch.ones(3, 32), torch.ones(2, 32)])
    assert FeatureStore.open(folder, [3, 2]) is not None
    shard = folder / "shard-00000.safetensors"
    shard.write_bytes(b"\0" * 7)  # cut short
    assert FeatureStore.open(folder, [3, 2]) is None
    assert f"note: feature shard '{shard}' is missing, not a readable safetensors file" in capsys.readouterr().out


# -- writing heads: nothing but a head is replaced ----------------------------------------------------------------
def test_export_refuses_a_directory_that_is_not_a_head(files, tmp_path, capsys):
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("keep me")
    rc, line = cli(capsys, "export", "--draft", files / "head", "--out", mine)
    assert rc == 2 and line == (f"eagle export: error: --out '{mine}' exists and is not a head directory (it holds "
                                "notes.txt): nothing was written; name a new directory for the head")
    assert (mine / "notes.txt").read_text() == "keep me" and len(list(tmp_path.iterdir())) == 1
    # a model directory (config.json and model.safetensors too, and tokenizer files) is not a head either
    rc, line = cli(capsys, "export", "--draft", files / "head", "--out", files / "tiny")
    assert rc == 2 and "(it holds chat_template.jinja, generation_config.json, tokenizer.json and 1 more)" in line
    (tmp_path / "file").write_text("x")
    rc, line = cli(capsys, "export", "--draft", files / "head", "--out", tmp_path / "file")
    assert rc == 2 and "exists and is not a head directory (it is a file)" in line
    rc, line = cli(capsys, "export", "--draft", files / "head", "--out", files / "head")
    assert rc == 2 and line.startswith(f"eagle export: error: --out '{files / 'head'}' is the --draft directory")
    # a head is replaced whole, and an empty directory made for it is fine
    (tmp_path / "pub").mkdir()
    for _ in range(2):  # (the fixture's head has an fc bias, which SGLang keeps and vLLM would drop)
        assert cli(capsys, "export", "--draft", files / "head", "--out", tmp_path / "pub", "--for", "sglang")[0] == 0
    assert sorted(p.name for p in (tmp_path / "pub").iterdir()) == ["config.json", "model.safetensors"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file", "mine", "pub"]


def test_save_pretrained_refuses_a_directory_that_is_not_a_head(target, tmp_path):
    (tmp_path / "h").mkdir()
    (tmp_path / "h/config.json").write_text(json.dumps({"model_type": "llama"}))  # a model's config, not a head's
    with pytest.raises(CheckpointError, match="h' exists and is not a head directory .its config.json and weights "
                                              "are not a draft head's."):
        tiny_head(target).save_pretrained(tmp_path / "h")
    (tmp_path / "g.prev").mkdir()  # the name a replaced head passes through is someone else's
    (tmp_path / "g.prev/a.txt").write_text("x")
    with pytest.raises(CheckpointError, match=r"g.prev' exists and is not a head directory \(it holds a.txt\)"):
        tiny_head(target).save_pretrained(tmp_path / "g")
    assert not (tmp_path / "g").exists()


def test_a_head_write_killed_between_its_renames_loses_nothing(target, tmp_path):
    """A kill between write_head_dir's renames leaves the old head as h.prev: loading h says where it is, and the
    next write puts the new head in place and removes it, with the temporary copy a killed writer left."""
    h = tmp_path / "h"
    tiny_head(target).save_pretrained(h)
    os.replace(h, tmp_path / "h.prev")
    with pytest.raises(CheckpointError, match=r"no config.json \(no such directory; an interrupted write left the "
                                              r"previous head in '.*h.prev'\)"):
        EagleHead.from_pretrained(h)
    dead = subprocess.Popen(["true"])  # a process id that no longer runs
    dead.wait()
    stale = tmp_path / f"h.tmp{dead.pid}"
    stale.mkdir()
    (stale / "config.json").write_text("{")  # cut short by the kill
    tiny_head(target, seed=2).save_pretrained(h)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["h"]
    assert torch.equal(EagleHead.from_pretrained(h).fc.weight, tiny_head(target, seed=2).fc.weight.float())


def test_train_refuses_an_out_that_is_not_a_head_before_training(files, tmp_path, capsys):
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "thesis.tex").write_text("years of work")
    rc, line = cli(capsys, "train", f"data.prepared={files / 'data'}", f"run_dir={tmp_path / 'run'}", f"out={mine}",
                   "model.target=no-such-target-is-loaded", "budget.max_steps=1")
    assert rc == 2 and line == (f"eagle train: error: out '{mine}' exists and is not a head directory (it holds "
                                "thesis.tex): nothing was written; name a new directory for the head")
    assert (mine / "thesis.tex").read_text() == "years of work" and not (tmp_path / "run").exists()
    rc, line = cli(capsys, "train", f"run_dir={tmp_path / 'run'}", f"out={tmp_path}", "budget.max_steps=1")
    assert rc == 2 and line == (f"eagle train: error: out '{tmp_path}' would hold run_dir '{tmp_path / 'run'}': name "
                                "a directory of its own for the head")


# -- training configs ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("args, message", [
    (("--config", "missing.yaml"), "config file 'missing.yaml' does not exist"),
    (("optim.lrr=1",), "unknown config key 'optim.lrr' (known: accumulate, batch_tokens, betas, dropout, grad_clip, lr, "
                       "warmup_steps, weight_decay)"),
    (("optim.lr",), "override 'optim.lr' is not of the form key=value"),
    (("optim.lr=fast",), "config key 'optim.lr' must be float, got 'fast'"),
    (("budget.max_steps=-5",), "budget.max_steps -5: a budget cannot be negative (0: no limit of that kind)"),
    (("optim.dropout=1.0", "budget.max_steps=1"), "optim.dropout 1.0: expected a rate >= 0 and < 1"),
    (("optim.lr=-1e-3", "budget.max_steps=1"), "optim.lr -0.001: expected a number >= 0 that float32 holds"),
    (("optim.lr=1e39", "budget.max_steps=1"), "optim.lr 1e+39: expected a number >= 0 that float32 holds"),
    (("budget.max_steps=1", "run_dir=RUN_FILE"), "run_dir 'RUN_FILE' is a file: name a directory for the checkpoints "
                                                 "and logs"),
    (("budget.max_steps=1", "data.prepared=NO_DATA", "model.target=TINY"),
     "prepared data 'NO_DATA/train.jsonl' does not exist: run `eagle prep --out NO_DATA` first"),
])
def test_training_configs_that_cannot_work(files, tmp_path, capsys, args, message):
    (tmp_path / "run-file").write_text("x")
    names = {"RUN_FILE": str(tmp_path / "run-file"), "NO_DATA": str(tmp_path / "no-data"), "TINY": str(files / "tiny")}
    for k, v in names.items():
        args = [a.replace(k, v) for a in args]
        message = message.replace(k, v)
    rc, line = cli(capsys, "train", f"out={tmp_path / 'head'}", f"run_dir={tmp_path / 'run'}", *args)
    assert rc == 2 and line == f"eagle train: error: {message}"


def test_prep_inputs_that_cannot_work(files, tmp_path, capsys):
    rc, line = cli(capsys, "prep", "--target", files / "tiny", "--data", tmp_path / "chats.jsonl", "--out", tmp_path)
    assert rc == 2 and line == f"eagle prep: error: data file '{tmp_path / 'chats.jsonl'}' does not exist"
    rc, line = cli(capsys, "prep", "--target", files / "plain", "--data", files / "ok.jsonl", "--out", tmp_path)
    assert rc == 2 and line == (f"eagle prep: error: tokenizer '{files / 'plain'}' has no chat template; use the "
                                "tokenizer of a chat/instruct model")
    rc, line = cli(capsys, "prep", "--target", files / "tiny", "--data", files / "ok.jsonl", "--out", tmp_path,
                   "--max-rows", -1)
    assert rc == 2 and line == "eagle prep: error: max_length and max_rows must be positive, got 2048 and -1"
    (tmp_path / "notes.txt").write_text("mine")
    rc, line = cli(capsys, "prep", "--target", files / "tiny", "--data", files / "ok.jsonl", "--out",
                   tmp_path / "notes.txt" / "data")  # refused before any work
    assert rc == 2 and line == (f"eagle prep: error: out '{tmp_path / 'notes.txt' / 'data'}': "
                                f"'{tmp_path / 'notes.txt'}' is a file, not a directory")


# -- a non-finite loss --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("bad_step", [0, 3])
def test_a_nan_loss_stops_naming_the_last_good_checkpoint(files, target, tmp_path, monkeypatch, bad_step):
    import train.loop as loop

    real_loss = loop.head_loss
    calls = []

    def nan_at_bad_step(head, ids, mask, feats, cfg, gen, noise=True):
        loss, m = real_loss(head, ids, mask, feats, cfg, gen, noise)
        if noise:  # a training step (validation passes noise=False)
            calls.append(1)
            if len(calls) == bad_step + 1:
                return loss * float("nan"), {**m, "loss": float("nan")}
        return loss, m

    monkeypatch.setattr(loop, "head_loss", nan_at_bad_step)
    (tmp_path / "data").symlink_to(files / "data")
    cfg = config(tmp_path, "budget.max_steps=8", "save_every_minutes=0", "eval.every_minutes=0", "cpu.fast_path=false")
    with pytest.raises(TrainError) as e:
        train(cfg, target=target)
    run = tmp_path / "run"
    if bad_step == 0:
        assert str(e.value) == ("loss is nan at step 0 (batch 0 of epoch 0): training stopped; no checkpoint was "
                                "written yet")
        assert not (run / "checkpoint").exists()
    else:
        assert str(e.value) == (f"loss is nan at step 3 (batch 0 of epoch 1): training stopped; the last "
                                f"checkpoint, {run / 'checkpoint'} (step 3), is kept (the weights this step started "
                                "from)")
        assert json.loads((run / "checkpoint/state.json").read_text())["step"] == 3


def test_weights_that_are_not_finite_never_replace_a_good_checkpoint(target, tmp_path):
    import train.loop as loop

    head = tiny_head(target)
    opt = loop.Optim.of(config(tmp_path), head, loop.Precision.of(config(tmp_path), torch.device("cpu"), target))
    loop.save_checkpoint(tmp_path, head, opt, TrainState(step=4))
    good = (tmp_path / "checkpoint/head/model.safetensors").read_bytes()
    with torch.no_grad():
        head.fc.weight[0, 0] = float("inf")
    with pytest.raises(TrainError, match=f"^the weights are not finite after step 5 \\(fc.weight\\): training stopped; "
                                         f"the last good checkpoint, {tmp_path / 'checkpoint'} \\(step 4\\), is kept$"):
        loop.save_checkpoint(tmp_path, head, opt, TrainState(step=5))
    assert (tmp_path / "checkpoint/head/model.safetensors").read_bytes() == good


# -- killed at any instant: resume from the last complete checkpoint ----------------------------------------------
def train_argv(files, run: Path) -> list[str]:
    return [sys.executable, str(ROOT / "eagle_cli.py"), "train", f"model.target={files / 'tiny'}",
            f"data.prepared={files / 'data'}", f"run_dir={run}", f"out={run / 'head'}", "optim.batch_tokens=256",
            "optim.warmup_steps=2", "optim.lr=3e-3", "budget.max_steps=150", "save_every_minutes=0",
            "eval.every_minutes=0", "eval.num_prompts=0", "cpu.fast_path=false", "num_threads=1", "tensorboard=false"]


def run_train(files, run: Path, fault: str = "") -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "EAGLE_FAULT"}
    if fault:
        env["EAGLE_FAULT"] = fault
    return subprocess.run(train_argv(files, run), env=env, capture_output=True, text=True, timeout=300)


def assert_same_heads(a: Path, b: Path) -> None:
    """The same heads bit for bit, and the same training records: each step once, with the same loss."""
    for sub in ("checkpoint/head", "head"):
        x, y = load_file(str(a / sub / "model.safetensors")), load_file(str(b / sub / "model.safetensors"))
        assert x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x), sub
    assert json.loads((a / "checkpoint/state.json").read_text())["step"] == 150
    logged = [[(r["step"], r.get("loss"), r.get("val_sim_tau")) for r in map(json.loads, (run / "log.jsonl").open())]
              for run in (a, b)]
    assert logged[0] == logged[1] and [s for s, loss, _ in logged[0] if loss is not None] == list(range(10, 151, 10))


@pytest.fixture(scope="module")
def straight(files, tmp_path_factory):
    """An uninterrupted run, and how many seconds its training loop took (the first step to the validation)."""
    run = tmp_path_factory.mktemp("straight") / "run"
    env = {**{k: v for k, v in os.environ.items() if k != "EAGLE_FAULT"}, "PYTHONUNBUFFERED": "1"}
    p = subprocess.Popen(train_argv(files, run), env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                         text=True)
    times = {}
    for line in p.stdout:
        for key in ("train rows", "validation:"):
            if key in line:
                times[key] = time.monotonic()
    assert p.wait(timeout=300) == 0 and len(times) == 2
    return run, times["validation:"] - times["train rows"]


def test_a_kill_between_the_checkpoint_renames_resumes_exactly(files, straight, tmp_path):
    run = tmp_path / "run"
    killed = run_train(files, run, fault="checkpoint-between-renames@7")
    assert killed.returncode == -signal.SIGKILL
    # the kill came after the old checkpoint (step 6) was renamed away and before the new one was renamed in
    assert not (run / "checkpoint").exists() and (run / "checkpoint.tmp").exists()
    assert json.loads((run / "checkpoint.prev/state.json").read_text())["step"] == 6
    resumed = run_train(files, run)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert "resuming at step 6" in resumed.stdout
    assert_same_heads(straight[0], run)
    assert sorted(p.name for p in run.iterdir()) == ["checkpoint", "config.yaml", "head", "log.jsonl"]


def test_kills_at_random_instants_resume_exactly(files, straight, tmp_path):
    """Three SIGKILLs at random instants after training starts (in a step, a checkpoint save, or the head's write),
    each within the first 20 % of an uninterrupted run's training time, then the same command to the end (where the
    machine's speed varies a run may finish before its kill: two of the three must land)."""
    run = tmp_path / "run"
    rng = random.Random(46)
    env = {**{k: v for k, v in os.environ.items() if k != "EAGLE_FAULT"}, "PYTHONUNBUFFERED": "1"}
    killed = []
    for _ in range(3):
        p = subprocess.Popen(train_argv(files, run), env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                             text=True)
        for line in p.stdout:  # printed once the rows and features are loaded, just before the first step
            if "train rows" in line:
                break
        time.sleep(rng.uniform(0.0, 0.2 * straight[1]))
        p.send_signal(signal.SIGKILL)
        p.stdout.close()
        killed.append(p.wait() == -signal.SIGKILL)
    resumed = run_train(files, run)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert killed.count(True) >= 2 and "resuming at step" in resumed.stdout
    assert_same_heads(straight[0], run)
