"""Training at the sizes users train, shown on tiny random Llamas: prep streams regenerated rows and their features to
the disk and resumes after a SIGKILL with no row lost or written twice; training on cached features loads the target
without its decoder layers and trains the very head the whole target trains; a float32 head trains beside a bf16
target. (Measured peak memory at real widths: benchmarks/memory_scale.py.)"""

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from test_train import config, write_prepared
from tiny import tiny_target

from data_prep import load_examples
from data_prep.prep import PrepConfig, prepare
from eagle.features import FeatureStore, features_dir
from eagle.target import load_target
from train.config import TrainError
from train.loop import train

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A tiny float32 Llama saved as a model directory (safetensors), and a prompt file."""
    d = tmp_path_factory.mktemp("scale")
    t = tiny_target(dtype=torch.float32)
    t.model.save_pretrained(d / "tiny")
    t.tokenizer.save_pretrained(d / "tiny")
    rows = [{"turns": [" ".join(f"w{(7 * i + j) % 80}" for j in range(3 + i % 5))]} for i in range(14)]
    (d / "prompts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return d


def prep_argv(d: Path, out: Path) -> list[str]:
    return ["prep", "--target", str(d / "tiny"), "--data", str(d / "prompts.jsonl"), "--out", str(out),
            "--regenerate", "--max-turns", "1", "--max-new-tokens", "9", "--max-length", "64",
            "--regen-batch-size", "3", "--val-fraction", "0.2"]


def read_split(out: Path, split: str, target):
    rows = load_examples(out / f"{split}.jsonl")
    lengths = [len(r.input_ids) for r in rows]
    return rows, FeatureStore.open(features_dir(out, split, target), lengths)


def test_a_prep_killed_mid_regeneration_resumes_with_no_row_lost_or_written_twice(model_dir, tmp_path):
    """SIGKILL once the journal has 2 shards (a shard a row here), then the same command: the rows taken from the
    journal are not generated again, and rows and features are those of an uninterrupted run."""
    from eagle_cli import main

    straight, out = tmp_path / "straight", tmp_path / "killed"
    assert main(prep_argv(model_dir, straight)) == 0
    script = ("import sys; sys.path.insert(0, sys.argv[1]); import data_prep.journal as j; j.SHARD_SECONDS = 0; "
              "import eagle_cli; sys.exit(eagle_cli.main(sys.argv[2:]))")
    env = {**os.environ, "EAGLE_FAULT": "journal-shard@2"}
    killed = subprocess.run([sys.executable, "-c", script, str(ROOT), *prep_argv(model_dir, out)], env=env,
                            capture_output=True, text=True, timeout=300)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
    index = json.loads((out / "regenerated/index.json").read_text())
    assert [len(s["rows"]) for s in index["shards"]] == [1, 1] and not (out / "summary.json").exists()

    made = []
    import data_prep.journal as journal

    real_add = journal.Journal.add
    journal.Journal.add = lambda self, conv, *a, **k: made.append(conv) or real_add(self, conv, *a, **k)
    try:
        assert main(prep_argv(model_dir, out)) == 0
    finally:
        journal.Journal.add = real_add
    first = {r for s in index["shards"] for r in s["rows"]}
    assert len(made) == len(set(made)) and not first & set(made)  # nothing generated twice
    rows = [r for s in json.loads((out / "regenerated/index.json").read_text())["shards"] for r in s["rows"]]
    assert len(rows) == len(set(rows)) == len(first) + len(made)  # each reply in the journal once
    target = load_target(str(model_dir / "tiny"))
    for split in ("train", "val"):
        (a, fa), (b, fb) = read_split(straight, split, target), read_split(out, split, target)
        assert [r.input_ids for r in a] == [r.input_ids for r in b] and fa is not None and fb is not None
        assert fb.dtype == torch.float32  # the target's dtype
        for i in range(len(a)):  # (rows batched with others: float sums in another order)
            torch.testing.assert_close(fa[i], fb[i], rtol=1e-4, atol=1e-5)


def test_prep_stores_features_in_the_targets_dtype_and_refers_to_its_journal(model_dir, tmp_path):
    """A bfloat16 target's features are stored in bfloat16; each split's store is an index into the journal's
    shards (no copy), and its rows equal a plain forward pass's features."""
    out = tmp_path / "out"
    cfg = PrepConfig(target=str(model_dir / "tiny"), data=str(model_dir / "prompts.jsonl"), out=str(out),
                     regenerate=True, max_turns=1, max_new_tokens=9, max_length=64, dtype="bfloat16")
    prepare(cfg)
    target = load_target(str(model_dir / "tiny"), dtype="bfloat16")
    rows = load_examples(out / "train.jsonl")
    folder = features_dir(out, "train", target, dtype=torch.bfloat16)
    feats = FeatureStore.open(folder, [len(r.input_ids) for r in rows])
    assert feats is not None and feats.dtype == torch.bfloat16
    assert not list(folder.glob("shard-*"))  # an index into ../regenerated
    for i, r in enumerate(rows[:4]):
        want = target.features(torch.tensor([r.input_ids]))[0]
        torch.testing.assert_close(feats[i][:-1].float(), want[:-1].float(), rtol=2e-2, atol=2e-2)


def test_a_target_loaded_without_its_layers(model_dir):
    """Embedding, final norm and lm_head read from the files alone, the layers on the meta device; the same identity
    as the whole target (so the same feature stores); `whole()` and `layer_weights` read the rest."""
    whole = load_target(str(model_dir / "tiny"))
    part = load_target(str(model_dir / "tiny"), layers=False)
    assert whole.has_layers and not part.has_layers
    assert all(p.is_meta for p in part.base.layers.parameters())
    for name in ("embed", "lm_head"):
        assert torch.equal(getattr(part, name).weight, getattr(whole, name).weight)
    assert torch.equal(part.base.norm.weight, whole.base.norm.weight)
    assert part.identity == whole.identity and part.fingerprint == whole.fingerprint
    assert part.identity != load_target(str(model_dir / "tiny"), dtype="bfloat16", layers=False).identity
    again = part.whole()
    assert again.has_layers and torch.equal(again.base.layers[1].mlp.up_proj.weight,
                                            whole.base.layers[1].mlp.up_proj.weight)
    got, want = part.layer_weights(-1), whole.base.layers[-1].state_dict()
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)


def test_training_on_cached_features_without_the_layers_trains_the_same_head(model_dir, tmp_path, monkeypatch):
    """`eagle train` on a directory target: with every feature cached, the head (EAGLE-1 from the target's last layer,
    and EAGLE-3) is bit for bit the one trained beside the whole target; the prompts decoded at validation load the
    whole target then, once."""
    import eagle.target

    loads = []
    real_whole, real_part = eagle.target.TargetModel.whole, eagle.target.model_without_layers
    monkeypatch.setattr(eagle.target.TargetModel, "whole", lambda t: loads.append("whole") or real_whole(t))
    monkeypatch.setattr(eagle.target, "model_without_layers",
                        lambda *a, **k: loads.append("part") or real_part(*a, **k))
    whole = load_target(str(model_dir / "tiny"))
    write_prepared(tmp_path / "data", whole)
    prompts = [{"messages": [{"role": "user", "content": text}]} for text in ("w3 w9 w27", "w5")]
    (tmp_path / "data/val_conversations.jsonl").write_text("".join(json.dumps(p) + "\n" for p in prompts))
    for kind in (["model.init=target_last_layer"], ["model.head_type=eagle3", "model.feature_layers=[0,1,2]"]):
        name = kind[0].split("=")[1]

        def run(side, *more):
            return config(tmp_path, f"model.target={model_dir / 'tiny'}", "budget.max_steps=6", "cpu.fast_path=false",
                          "eval.every_minutes=0", f"run_dir={tmp_path / name / side}",
                          f"out={tmp_path / name / side / 'head'}", *kind, *more)

        train(run("a"), target=whole)  # the whole target handed in (it computes and caches the features)
        loads.clear()
        train(run("b", "eval.num_prompts=2"))  # the target loaded by the run: without its layers
        assert loads == ["part", "whole"]  # then whole once, for the prompts, over every validation
        x = load_file(str(tmp_path / name / "a/checkpoint/head/model.safetensors"))
        y = load_file(str(tmp_path / name / "b/checkpoint/head/model.safetensors"))
        assert x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x), name
        log = [json.loads(line) for line in (tmp_path / name / "b/log.jsonl").read_text().splitlines()]
        assert [r["val_tau"] for r in log if "val_tau" in r]  # the prompts decoded with the whole target


def test_a_float32_head_trains_beside_a_bfloat16_target(tmp_path):
    """model.head_dtype float32 (the default) under a bfloat16 target: float32 weights and AdamW states, the loss
    falls, the checkpoint keeps float32 and the head in `out` is bfloat16 (model.save_dtype auto) or as asked;
    mixed_precision fp16 scales the loss and resumes its scale."""
    low = tiny_target(dtype=torch.bfloat16)
    write_prepared(tmp_path / "data", low)
    train(config(tmp_path, "budget.max_steps=40", "eval.every_minutes=0"), target=low)
    ckpt = load_file(str(tmp_path / "run/checkpoint/head/model.safetensors"))
    opt = torch.load(tmp_path / "run/checkpoint/optimizer.pt", weights_only=True)
    assert {v.dtype for v in ckpt.values() if v.is_floating_point()} == {torch.float32}
    assert {s["exp_avg"].dtype for s in opt["state"].values()} == {torch.float32}
    out = load_file(str(tmp_path / "head/model.safetensors"))
    assert {v.dtype for v in out.values() if v.is_floating_point()} == {torch.bfloat16}
    losses = [r["loss"] for r in map(json.loads, (tmp_path / "run/log.jsonl").read_text().splitlines()) if "loss" in r]
    assert sum(losses[-5:]) < 0.9 * sum(losses[:5])
    fp16 = ("budget.max_steps=12", "eval.every_minutes=0", "mixed_precision=fp16", "model.save_dtype=float32")
    train(config(tmp_path, *fp16, f"run_dir={tmp_path / 'fp16'}", f"out={tmp_path / 'h16'}"), target=low)
    state = json.loads((tmp_path / "fp16/checkpoint/state.json").read_text())
    assert state["loss_scale"]["scale"] > 0
    out = load_file(str(tmp_path / "h16/model.safetensors"))
    assert {v.dtype for v in out.values() if v.is_floating_point()} == {torch.float32}
    # killed after step 6's checkpoint, then resumed: the very head of the straight run (the loss scale resumed too)
    import train.loop as loop

    real_save = loop.save_checkpoint

    def save_then_die(run, head, optim, state):
        real_save(run, head, optim, state)
        if state.step == 6:
            raise KeyboardInterrupt

    killed = config(tmp_path, *fp16, "save_every_minutes=0", f"run_dir={tmp_path / 'k16'}", f"out={tmp_path / 'hk16'}")
    with pytest.MonkeyPatch.context() as m:
        m.setattr(loop, "save_checkpoint", save_then_die)
        with pytest.raises(KeyboardInterrupt):
            train(killed, target=low)
    train(killed, target=low)
    a, b = (load_file(str(tmp_path / r / "checkpoint/head/model.safetensors")) for r in ("fp16", "k16"))
    assert all(torch.equal(a[k], b[k]) for k in a)
    with pytest.raises(TrainError, match="^mixed_precision fp16 scales the loss for float32 master weights"):
        train(config(tmp_path, *fp16, "model.head_dtype=float16"), target=low)


def test_plan_counts_the_rows_prep_makes_and_bounds_their_features(model_dir, tmp_path, capsys):
    """`eagle plan --json`: the feature bytes are every kept prompt plus max_new_tokens, at the target's width and
    dtype, and bound what prep then writes; the keys the issue names are there."""
    from eagle_cli import main

    capsys.readouterr()
    assert main(["plan", "--target", str(model_dir / "tiny"), "--data", str(model_dir / "prompts.jsonl"),
                 "--max-new-tokens", "9", "--max-length", "64", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert plan["feature_disk_bytes"] > 0 and plan["prep_peak_host_bytes"] > plan["prep_parts"]["target"] > 0
    assert plan["train_peak_device_bytes"] > 0 and plan["max_batch_tokens"] > 0 and plan["rows"] == 14
    prep = PrepConfig(target=str(model_dir / "tiny"), data=str(model_dir / "prompts.jsonl"), out=str(tmp_path / "out"),
                      regenerate=True, max_turns=1, max_new_tokens=9, max_length=64)
    prepare(prep)
    written = sum(len(r.input_ids) for s in ("train", "val") for r in load_examples(tmp_path / f"out/{s}.jsonl"))
    assert written * 32 * 4 <= plan["feature_disk_bytes"] == plan["tokens"] * 32 * 4


def test_runs_that_do_not_fit_are_refused_before_the_target_loads(model_dir, tmp_path, monkeypatch, capsys):
    """Prep's features against the free disk, training's process against the free memory: one line each with the
    number needed and the number there, before any weight is read."""
    import shutil

    import eagle.target
    import train.plan
    from eagle_cli import main

    import train.loop

    def no_load(*a, **k):
        raise AssertionError("the target was loaded")

    monkeypatch.setattr(eagle.target, "load_target", no_load)
    usage = shutil.disk_usage(tmp_path)
    monkeypatch.setattr(shutil, "disk_usage", lambda p: usage._replace(free=3000))
    capsys.readouterr()
    assert main(prep_argv(model_dir, tmp_path / "out")) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("eagle prep: error: target features of the regenerated rows: 0.00 GiB do not fit in ")
    assert "(0.00 GiB free)" in err and not (tmp_path / "out/regenerated").exists()
    monkeypatch.undo()

    whole = load_target(str(model_dir / "tiny"))
    write_prepared(tmp_path / "data", whole)
    monkeypatch.setattr(train.loop, "load_target", no_load)
    monkeypatch.setattr(train.plan, "available_ram", lambda: 1000)
    argv = ["train", f"model.target={model_dir / 'tiny'}", f"data.prepared={tmp_path / 'data'}",
            f"run_dir={tmp_path / 'run'}", f"out={tmp_path / 'head'}", "budget.max_steps=1", "device=cpu"]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("eagle train: error: training needs ") and " on cpu (target " in err
    assert err.endswith(", 0.00 GiB free: no batch fits: use a device with more memory")
    monkeypatch.setattr(train.plan, "available_ram", lambda: 24 << 20)  # room for some batch, not for 8,192 tokens
    assert main([*argv, "optim.batch_tokens=8192"]) == 2
    assert "0.02 GiB free: lower optim.batch_tokens to " in capsys.readouterr().err


@pytest.mark.parametrize("family", ["llama-tied", "gemma3", "gemma3-multimodal", "qwen2", "phi3"])
def test_families_load_without_their_layers_as_they_load_whole(family, tmp_path):
    """Buffers outside the layers (Gemma's embedding scale) come with their values, tied embeddings stay tied, a
    checkpoint in shards is read through its index: the embedding's output, the lm_head and the final norm's gain
    are the whole model's, and so is the identity."""
    from test_families import tiny_family

    from eagle.head import final_norm_gain

    t = tiny_family(family.removesuffix("-tied"))
    if family == "llama-tied":
        t.model.config.tie_word_embeddings = True
        t.model.lm_head.weight = t.model.get_input_embeddings().weight
    t.model.save_pretrained(tmp_path / "m", max_shard_size="20KB")  # several shards and an index
    t.tokenizer.save_pretrained(tmp_path / "m")
    assert (tmp_path / "m/model.safetensors.index.json").exists()
    whole = load_target(str(tmp_path / "m"))
    part = load_target(str(tmp_path / "m"), layers=False)
    assert not part.has_layers and part.identity == whole.identity
    ids = torch.tensor([[5, 9, 14, 3]])
    assert torch.equal(part.embed(ids), whole.embed(ids))
    assert torch.equal(part.lm_head.weight, whole.lm_head.weight)
    assert torch.equal(final_norm_gain(part), final_norm_gain(whole))
    if family == "llama-tied":
        assert part.lm_head.weight is part.embed.weight


def test_a_hub_target_loaded_without_its_layers_fetches_only_the_shards_it_reads(model_dir, tmp_path):
    """A hub id, offline from the hub's cache holding the config, tokenizer, index and only the shards of the
    embedding, final norm and lm_head (no layer shard at all): loaded without its layers it needs nothing more, and
    its identity is the snapshot's commit."""
    import shutil

    t = load_target(str(model_dir / "tiny"))
    src = tmp_path / "src"
    t.model.save_pretrained(src, max_shard_size="20KB")
    t.tokenizer.save_pretrained(src)
    snap = tmp_path / "hub/models--org--tiny/snapshots/0123abcd"
    snap.mkdir(parents=True)
    (tmp_path / "hub/models--org--tiny/refs").mkdir()
    (tmp_path / "hub/models--org--tiny/refs/main").write_text("0123abcd")
    weight_map = json.loads((src / "model.safetensors.index.json").read_text())["weight_map"]
    ends = {weight_map[k] for k in weight_map if ".layers." not in k}
    for f in src.iterdir():
        if not f.name.endswith(".safetensors") or f.name in ends:
            shutil.copy(f, snap / f.name)
    assert len(ends) < len(set(weight_map.values()))  # some shards hold layers alone, and are not there
    script = ("import sys; sys.path.insert(0, sys.argv[1]); from eagle.target import load_target; "
              "t = load_target('org/tiny', layers=False); "
              "print(t.has_layers, t.identity, float(t.lm_head.weight.abs().sum()))")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(tmp_path / "hub"), "HF_HOME": str(tmp_path)}
    done = subprocess.run([sys.executable, "-c", script, str(ROOT)], env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    has_layers, identity, lm_sum = done.stdout.split()
    assert has_layers == "False" and float(lm_sum) == pytest.approx(float(t.lm_head.weight.abs().sum()))
    assert identity != t.identity  # named by the snapshot, not by the files of another folder
