"""The feature store (eagle.features): shards written as features are computed, rows read one at a time, a killed
pass resumed after its last complete shard, the disk's room checked before writing, and training on features four
times larger than the memory it is allowed."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from tiny import tiny_target

import eagle.features as features
from eagle.features import FeatureStore, FeatureWriter, features_dir

ROOT = Path(__file__).resolve().parents[1]


def test_a_store_reads_back_its_rows_from_shards_in_any_order(tmp_path, monkeypatch):
    monkeypatch.setattr(features, "SHARD_BYTES", 3 * 16 * 4)  # about three 4-token rows a shard
    g = torch.Generator().manual_seed(0)
    rows = [torch.randn(n, 16, generator=g) for n in (4, 1, 7, 3, 4, 2)]
    lengths = [r.shape[0] for r in rows]
    for dtype in (torch.float32, torch.bfloat16):
        folder = tmp_path / str(dtype)
        with FeatureWriter(folder, lengths, 16, dtype) as w:
            for i in (5, 0, 3, 1, 4, 2):  # as batches sorted by length would hand them over
                w.add(i, rows[i])
        assert len(list(folder.glob("shard-*.safetensors"))) > 1
        store = FeatureStore.open(folder, lengths)
        assert all(torch.equal(store[i], rows[i].to(dtype)) for i in range(len(rows)))
        view = store.take([2, 0])
        assert len(view) == 2 and torch.equal(view[0], store[2]) and torch.equal(view[1], store[0])
    both = FeatureStore.concat([FeatureStore.open(tmp_path / "torch.float32", lengths)] * 2)
    assert len(both) == 12 and torch.equal(both[8], rows[2])
    assert FeatureStore.open(tmp_path / "torch.float32", lengths[:-1]) is None  # made for other rows


def test_a_killed_feature_pass_resumes_after_its_last_complete_shard(tmp_path, monkeypatch):
    import train.features as loop
    from test_train import config, write_prepared

    from train.data import load_rows

    target = tiny_target(dtype=torch.float32)
    write_prepared(tmp_path / "data", target)
    rows = load_rows(config(tmp_path), "train", str(tmp_path / "data"))
    monkeypatch.setattr(features, "SHARD_BYTES", 32 * 4 * 40)  # a shard every ~40 tokens
    real, seen = loop.target_features, []

    def killed(target, rows, todo, writer, desc, layers=None, *rest):
        class Dies:  # the writer of a process killed after 12 rows
            dtype = writer.dtype

            def add(self, i, f):
                if len(seen) == 12:
                    raise KeyboardInterrupt
                seen.append(i)
                writer.add(i, f)
        real(target, rows, todo, Dies(), desc, layers)

    monkeypatch.setattr(loop, "target_features", killed)
    with pytest.raises(KeyboardInterrupt):
        loop.cached_features(target, rows, tmp_path / "data", "train")
    folder = features_dir(tmp_path / "data", "train", target)
    index = json.loads((folder / "index.json").read_text())
    kept = {i for s in index["shards"] for i in s["rows"]}
    assert not index["complete"] and 0 < len(kept) <= 12 and kept <= set(seen)
    (folder / "shard-99999.safetensors").write_bytes(b"half")  # as a kill mid-write leaves one: never read
    computed = []
    monkeypatch.setattr(loop, "target_features", lambda t, r, todo, w, d, layers=None, *rest:
                        computed.extend(todo) or real(t, r, todo, w, d, layers))
    store = loop.cached_features(target, rows, tmp_path / "data", "train")
    assert sorted(computed) == sorted(set(range(len(rows))) - kept)  # only what no complete shard held
    assert not (folder / "shard-99999.safetensors").exists()
    whole = FeatureStore.open(folder, [len(r[0]) for r in rows])
    fresh = tmp_path / "fresh"
    with FeatureWriter(fresh, [len(r[0]) for r in rows], 32, torch.float32) as w:
        real(target, rows, w.missing(), w, "again")
    again = FeatureStore.open(fresh, [len(r[0]) for r in rows])
    assert all(torch.equal(store[i], again[i]) and torch.equal(whole[i], again[i]) for i in range(len(rows)))


def test_a_shard_cut_short_after_the_pass_is_computed_again_and_nothing_else(tmp_path, monkeypatch):
    import train.features as loop
    from test_train import config, write_prepared

    from train.data import load_rows

    target = tiny_target(dtype=torch.float32)
    write_prepared(tmp_path / "data", target)
    rows = load_rows(config(tmp_path), "train", str(tmp_path / "data"))
    monkeypatch.setattr(features, "SHARD_BYTES", 32 * 4 * 40)
    first = loop.cached_features(target, rows, tmp_path / "data", "train")
    want = [first[i].clone() for i in range(len(rows))]
    folder = features_dir(tmp_path / "data", "train", target)
    index = json.loads((folder / "index.json").read_text())
    assert len(index["shards"]) >= 3
    cut = folder / index["shards"][1]["file"]
    cut.write_bytes(cut.read_bytes()[:-4])  # a copy that stopped 4 bytes short: the header is intact
    assert FeatureStore.open(folder, [len(r[0]) for r in rows]) is None
    real, computed = loop.target_features, []
    monkeypatch.setattr(loop, "target_features",
                        lambda t, r, todo, w, d, layers=None, *rest:
                        computed.extend(todo) or real(t, r, todo, w, d, layers))
    store = loop.cached_features(target, rows, tmp_path / "data", "train")
    assert sorted(computed) == sorted(index["shards"][1]["rows"])
    for i in range(len(rows)):  # the same features (recomputed rows batch with other rows: float sums may differ)
        torch.testing.assert_close(store[i], want[i], rtol=1e-4, atol=1e-5)


def test_features_that_do_not_fit_on_the_disk_are_refused_before_any_is_written(tmp_path, monkeypatch, capsys):
    from test_train import write_prepared

    from eagle_cli import main

    target = tiny_target(dtype=torch.float32)
    target.model.save_pretrained(tmp_path / "tiny")
    target.tokenizer.save_pretrained(tmp_path / "tiny")
    write_prepared(tmp_path / "data", target)
    usage = shutil.disk_usage(tmp_path)
    monkeypatch.setattr(features.shutil, "disk_usage", lambda p: usage._replace(free=1000))
    rc = main(["train", f"model.target={tmp_path / 'tiny'}", f"data.prepared={tmp_path / 'data'}",
               f"run_dir={tmp_path / 'run'}", f"out={tmp_path / 'head'}", "budget.max_steps=1", "device=cpu"])
    out = capsys.readouterr()
    assert rc == 2 and "MiB in" in out.out  # the size, said first
    line = out.err.strip().splitlines()[-1]
    assert line.startswith("eagle train: error: target features (train): 0.00 GiB do not fit in ")
    assert "(0.00 GiB free); free some room, keep the features in bfloat16" in line
    assert not list(tmp_path.glob("data/features-*/shard-*"))


CAP_MB = 768


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads the peak memory from Linux's /proc")
@pytest.mark.skipif(shutil.disk_usage("/tmp").free < 8 << 30, reason="needs 8 GiB free on the disk")
def test_training_reads_features_four_times_its_memory_cap(tmp_path):
    """A store of 3.4 GB (float32 features of 1.6M tokens, hidden size 512) and a training run in a subprocess whose
    peak resident memory stays under CAP_MB: batches are read row by row from the shards."""
    target = tiny_target(dtype=torch.float32, hidden=512)
    target.model.save_pretrained(tmp_path / "tiny")
    target.tokenizer.save_pretrained(tmp_path / "tiny")
    from eagle import load_target

    target = load_target(str(tmp_path / "tiny"))  # the identity the run will see
    g = torch.Generator().manual_seed(0)
    n_rows, T = 3200, 512
    data = tmp_path / "data"
    data.mkdir()
    ids = torch.randint(4, 90, (n_rows + 8, T), generator=g)
    with open(data / "train.jsonl", "w") as f:
        for r in ids[:n_rows].tolist():
            f.write(json.dumps({"input_ids": r, "loss_mask": [0] * 8 + [1] * (T - 8)}) + "\n")
    with open(data / "val.jsonl", "w") as f:
        for r in ids[n_rows:, :64].tolist():
            f.write(json.dumps({"input_ids": r, "loss_mask": [0] * 8 + [1] * 56}) + "\n")
    block = torch.randn(T, 512, generator=g)
    folder = features_dir(data, "train", target)
    with FeatureWriter(folder, [T] * n_rows, 512, torch.float32) as w:
        for i in w.missing():
            w.add(i, block)
    size = sum(f.stat().st_size for f in folder.glob("shard-*"))
    assert size >= 4 * CAP_MB * 2**20
    probe = f"""
import sys
sys.path[:0] = [{str(ROOT)!r}]
from eagle.configio import load_config
from train.config import TrainConfig
from train.loop import train
cfg = load_config(TrainConfig, None, ["model.target={tmp_path / 'tiny'}", "data.prepared={data}",
                  "run_dir={tmp_path / 'run'}", "out={tmp_path / 'head'}", "device=cpu", "budget.max_steps=6",
                  "optim.batch_tokens=2048", "eval.num_prompts=0", "eval.every_minutes=0", "tensorboard=false",
                  "cpu.fast_path=false", "data.val_overlap=2", "save_every_minutes=100"])
state = train(cfg)
# VmHWM: this process image's peak resident memory (ru_maxrss would keep the forking parent's across exec)
peak_kb = int(open("/proc/self/status").read().split("VmHWM:")[1].split()[0])
print("steps", state.step, "peak_mb", peak_kb / 1024)
"""
    env = {**os.environ, "OMP_NUM_THREADS": "2"}
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=600, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    last = done.stdout.strip().splitlines()[-1].split()
    assert last[:2] == ["steps", "6"]
    assert float(last[3]) < CAP_MB, f"peak resident memory {last[3]} MB with {size / 2**20:.0f} MB of features"
