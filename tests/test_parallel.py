"""Training in several processes (train.parallel), tested with two CPU processes over gloo (`torchrun`): the same
weights as one process taking both micro-batches of each step, one writer for every file, and a resume that needs
the same number of processes."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file
from tiny import tiny_target

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """A tiny target saved as a model directory, and rows it wrote itself, prepared."""
    from test_train import write_prepared

    d = tmp_path_factory.mktemp("parallel")
    target = tiny_target(dtype=torch.float32)
    target.model.save_pretrained(d / "tiny")
    target.tokenizer.save_pretrained(d / "tiny")
    write_prepared(d / "data", target, rows=40)
    (d / "data/val_conversations.jsonl").write_text("\n".join(  # held-out prompts, decoded at validation
        json.dumps({"messages": [{"role": "user", "content": f"w{i} w{i + 7} w{i + 2}"}]}) for i in range(2)))
    return d


def run_train(setup: Path, name: str, processes: int, *overrides: str) -> subprocess.CompletedProcess:
    launcher = ([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(processes),
                 "--master_port", str(29500 + os.getpid() % 1000)] if processes > 1 else [sys.executable])
    argv = [*launcher, str(ROOT / "eagle_cli.py"), "train", f"model.target={setup / 'tiny'}",
            f"data.prepared={setup / 'data'}", f"run_dir={setup / name / 'run'}", f"out={setup / name / 'head'}",
            "device=cpu", "optim.batch_tokens=128", "optim.warmup_steps=2", "optim.lr=3e-3", "budget.max_steps=8",
            "save_every_minutes=0", "eval.every_minutes=0", "eval.num_prompts=2", "eval.max_new_tokens=8",
            "log_every=1", "tensorboard=false", "num_threads=1", "cpu.fast_path=false", *overrides]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "EAGLE_FAULT")}
    return subprocess.run(argv, capture_output=True, text=True, timeout=600, env=env, cwd=ROOT)


def test_two_processes_take_the_steps_of_one_with_two_micro_batches_and_one_writes(setup):
    two = run_train(setup, "two", 2)
    assert two.returncode == 0, two.stderr[-3000:]
    one = run_train(setup, "one", 1, "optim.accumulate=2")
    assert one.returncode == 0, one.stderr[-3000:]
    for sub in ("head", "run/checkpoint/head"):
        a = load_file(str(setup / "two" / sub / "model.safetensors"))
        b = load_file(str(setup / "one" / sub / "model.safetensors"))
        assert a.keys() == b.keys()
        for k in a:
            torch.testing.assert_close(a[k], b[k], rtol=1e-4, atol=1e-5, msg=k)
    # the console says how many processes ran, once; the saved config too
    assert two.stdout.count("(2 processes,") == 1 and "(1 process," in one.stdout
    assert yaml.safe_load((setup / "two/run/config.yaml").read_text())["num_processes"] == 2
    # one writer: every step logged once, the same steps and losses as one process (to float32 sums' order)
    logs = [[json.loads(line) for line in (setup / name / "run/log.jsonl").read_text().splitlines()]
            for name in ("two", "one")]
    assert [r["step"] for r in logs[0]] == [r["step"] for r in logs[1]] == [*range(1, 9), 8]
    for a, b in zip(*logs):
        if "loss" in a:
            assert a["loss"] == pytest.approx(b["loss"], rel=1e-4)
    assert logs[0][-1]["val_sim_tau"] == pytest.approx(logs[1][-1]["val_sim_tau"], abs=1e-6)
    assert "val_tau" in logs[0][-1]  # decoded on the main process, broadcast
    assert sorted(p.name for p in (setup / "two/run").iterdir()) == ["checkpoint", "config.yaml", "log.jsonl"]
    assert json.loads((setup / "two/run/checkpoint/state.json").read_text())["num_processes"] == 2


def test_a_run_resumes_only_with_its_number_of_processes(setup):
    first = run_train(setup, "resume", 2, "budget.max_steps=4")
    assert first.returncode == 0, first.stderr[-3000:]
    state = json.loads((setup / "resume/run/checkpoint/state.json").read_text())
    assert state["step"] == 4 and state["done"]
    # a finished run extended (a longer budget) by another number of processes is refused in one line
    (setup / "resume/run/checkpoint/state.json").write_text(json.dumps({**state, "done": False}))
    other = run_train(setup, "resume", 1, "budget.max_steps=6")
    assert other.returncode == 2
    assert other.stderr.strip().splitlines()[-1] == (
        f"eagle train: error: run_dir '{setup / 'resume/run'}' was trained by 2 processes: resume it with 2 "
        "(launched: 1), or start a new run_dir")
    again = run_train(setup, "resume", 2, "budget.max_steps=6")
    assert again.returncode == 0, again.stderr[-3000:]
    assert "resuming at step 4" in again.stdout
    assert json.loads((setup / "resume/run/checkpoint/state.json").read_text())["step"] == 6


def test_a_target_spread_by_a_device_map_trains_online(setup, tmp_path):
    # model.device_map=auto: transformers and accelerate place the target (here, a CPU-only machine: all on the CPU)
    done = run_train(setup, "mapped", 1, "model.device_map=auto", "data.online=true", "budget.max_steps=2")
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads((setup / "mapped/run/checkpoint/state.json").read_text())["step"] == 2


def test_launches_the_loop_does_not_serve_are_one_line_errors():
    from types import SimpleNamespace

    from accelerate.utils import DistributedType

    from train.config import TrainConfig
    from train.config import TrainError
    from train.loop import check_launch
    from train.precision import Precision

    def launch(kind=DistributedType.NO, precision="no", processes=1):
        return SimpleNamespace(distributed_type=kind, mixed_precision=precision, num_processes=processes)

    def check(cfg, accelerator):  # on a CPU: mixed_precision auto is none there
        check_launch(cfg, accelerator, Precision.of(cfg, torch.device("cpu")))

    cfg = TrainConfig()
    check(cfg, launch(DistributedType.MULTI_GPU, "no", 2))
    with pytest.raises(TrainError, match="^accelerate launched with distributed_type DEEPSPEED: "):
        check(cfg, launch(DistributedType.DEEPSPEED))
    with pytest.raises(TrainError, match="^accelerate's mixed_precision is fp16 but the config's mixed_precision is "
                                         "none: "):
        check(cfg, launch(precision="fp16"))
    cfg.mixed_precision = "bf16"
    check(cfg, launch(precision="bf16"))
    cfg.model.device_map = "auto"
    with pytest.raises(TrainError, match="^model.device_map 'auto' spreads one target over the devices; with 2 "):
        check(cfg, launch(processes=2))


def test_two_processes_share_the_feature_pass_and_write_one_processs_store(setup, tmp_path):
    """With no features cached, each of 2 processes computes every other batch of the pass into its own shards, and
    the main process joins them in one index: the store reads row for row, bit for bit, what one process writes."""
    import shutil

    from eagle.features import FeatureStore
    from eagle.target import load_target
    from train.config import TrainConfig
    from train.data import load_rows

    for name in ("a", "b"):
        (tmp_path / name).mkdir()
        for f in ("train.jsonl", "val.jsonl"):
            shutil.copy(setup / "data" / f, tmp_path / name / f)
    runs = {}
    for name, processes in (("a", 2), ("b", 1)):
        runs[name] = run_train(setup, f"share-{name}", processes, f"data.prepared={tmp_path / name}",
                               "budget.max_steps=1", "eval.num_prompts=0", "data.pass_tokens=128")
        assert runs[name].returncode == 0, runs[name].stderr[-3000:]
    assert "2 processes share the pass" in runs["a"].stdout
    cfg = TrainConfig()
    rows = load_rows(cfg, "train", str(tmp_path / "a"))
    lengths = [len(r[0]) for r in rows]
    target = load_target(str(setup / "tiny"), layers=False)
    from eagle.features import features_dir

    a = features_dir(tmp_path / "a", "train", target)
    b = features_dir(tmp_path / "b", "train", target)
    assert {f.name.split("-")[1] for f in a.glob("shard-*")} == {"p0", "p1"} and not list(a.glob("index-p*"))
    sa, sb = FeatureStore.open(a, lengths), FeatureStore.open(b, lengths)
    assert all(torch.equal(sa[i], sb[i]) for i in range(len(lengths)))
