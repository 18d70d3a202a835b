"""Training on a tiny random Llama: the loss falls, checkpoints resume, bad input is refused clearly."""

import importlib.util
import json
import math

import pytest
import torch
from paths import force_switches
from tiny import tiny_target

from eagle import EagleHead
from eagle.configio import load_config
from train.config import TrainConfig
from train.config import TrainError
from train.data import drop_val_rows
from train.loop import train


def write_prepared(path, target, rows=24, seed=0):
    """Rows the target itself wrote greedily (as regeneration would), assistant-masked after a short prompt."""
    from infer import SpeculativeDecoder

    g = torch.Generator().manual_seed(seed)
    dec = SpeculativeDecoder(target, None)
    path.mkdir(parents=True)
    lines = []
    for _ in range(rows):
        prompt = torch.randint(4, 90, (6,), generator=g).tolist()
        reply = dec.generate(prompt, 24, speculative=False).token_ids
        lines.append(json.dumps({"input_ids": prompt + reply, "loss_mask": [0] * 6 + [1] * len(reply)}))
    (path / "train.jsonl").write_text("\n".join(lines[4:]) + "\n")
    (path / "val.jsonl").write_text("\n".join(lines[:4]) + "\n")


def config(tmp_path, *overrides):
    return load_config(TrainConfig, None, [f"data.prepared={tmp_path / 'data'}", f"run_dir={tmp_path / 'run'}",
                                           f"out={tmp_path / 'head'}", "optim.batch_tokens=256", "log_every=1",
                                           "eval.num_prompts=0", "optim.warmup_steps=2", "optim.lr=3e-3", *overrides])


@pytest.fixture(scope="module")
def target():
    return tiny_target(dtype=torch.float32)


def test_training_lowers_the_loss_and_exports_a_loadable_head(tmp_path, target, capsys):
    write_prepared(tmp_path / "data", target)
    state = train(config(tmp_path, "budget.max_steps=40", "model.draft_vocab=40"), target=target)
    log = [json.loads(l) for l in (tmp_path / "run/log.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in log if "loss" in r]
    assert state.done and state.step == 40
    assert sum(losses[-5:]) / 5 < 0.85 * sum(losses[:5]) / 5
    head = EagleHead.from_pretrained(tmp_path / "head").attach(target)
    assert head.config.draft_vocab_size == 40
    assert (tmp_path / "run/config.yaml").exists()
    assert "MiB in " in capsys.readouterr().out  # the feature cache's size, said before writing it
    if importlib.util.find_spec("tensorboard"):
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

        events = EventAccumulator(str(tmp_path / "run/tensorboard"))
        events.Reload()
        assert {"train/loss", "val/val_sim_tau", "val/val_sim_accept_1"} <= set(events.Tags()["scalars"])
        assert len(events.Scalars("train/loss")) == len(losses)


@pytest.mark.parametrize("head", ["eagle1", "eagle3"])
def test_bf16_mixed_precision_learns_and_keeps_float32_weights(tmp_path, target, head):
    """mixed_precision=bf16 runs the step's products in bfloat16 under autocast: the loss falls as in float32, the
    saved head is float32, and its losses are close to float32's: at the first step (same weights, same batch) and
    over the last five."""
    write_prepared(tmp_path / "data", target)
    kind = ["model.draft_vocab=40"] + (["model.head_type=eagle3", "model.feature_layers=[0,1,2]", "loss.steps=2",
                                        "optim.lr=1e-2"] if head == "eagle3" else [])
    first, last = {}, {}
    for mp in ("none", "bf16"):
        train(config(tmp_path, "budget.max_steps=40", f"mixed_precision={mp}", f"run_dir={tmp_path / mp}",
                     f"out={tmp_path / mp / 'head'}", *kind), target=target)
        losses = [r["loss"] for r in map(json.loads, (tmp_path / mp / "log.jsonl").read_text().splitlines())
                  if "loss" in r]
        assert sum(losses[-5:]) / 5 < 0.9 * sum(losses[:5]) / 5
        first[mp], last[mp] = losses[0], sum(losses[-5:]) / 5
    assert first["bf16"] == pytest.approx(first["none"], rel=0.02) and first["bf16"] != first["none"]
    assert last["bf16"] == pytest.approx(last["none"], rel=0.03)
    saved = EagleHead.from_pretrained(tmp_path / "bf16/head").trainable_state_dict()
    assert {v.dtype for v in saved.values() if v.is_floating_point()} == {torch.float32}
    with pytest.raises(TrainError, match="mixed_precision 'fp8': expected auto, none, bf16 or fp16"):
        train(config(tmp_path, "budget.max_steps=1", "mixed_precision=fp8"), target=target)


def test_resume_continues_exactly(tmp_path, target, monkeypatch):
    import train.loop as loop

    write_prepared(tmp_path / "data", target)
    straight = train(config(tmp_path, "budget.max_steps=12", "run_dir=" + str(tmp_path / "a")), target=target)

    real_save = loop.save_checkpoint

    def save_then_die(run, head, opt, state):  # the process is killed right after the step-6 checkpoint
        real_save(run, head, opt, state)
        if state.step == 6:
            raise KeyboardInterrupt

    monkeypatch.setattr(loop, "save_checkpoint", save_then_die)
    killed = config(tmp_path, "budget.max_steps=12", "run_dir=" + str(tmp_path / "b"), "save_every_minutes=0")
    with pytest.raises(KeyboardInterrupt):
        train(killed, target=target)
    monkeypatch.setattr(loop, "save_checkpoint", real_save)
    other = config(tmp_path, "budget.max_steps=12", "run_dir=" + str(tmp_path / "b"), "optim.accumulate=2")
    with pytest.raises(TrainError, match=r"was trained with optim.accumulate 1: resume it with 1 \(given: 2\)"):
        train(other, target=target)  # its batches would not be the ones the checkpoint's place in the epoch counts
    resumed = train(killed, target=target)  # the same command again
    assert resumed.step == straight.step == 12
    a = EagleHead.from_pretrained(tmp_path / "a/checkpoint/head").trainable_state_dict()
    b = EagleHead.from_pretrained(tmp_path / "b/checkpoint/head").trainable_state_dict()
    for k in a:
        torch.testing.assert_close(a[k], b[k])


def test_all_positions_scores_the_prompt_too(tmp_path, target):
    """loss.positions=all scores every position of a row (28 of a 30-token row: predictions start two tokens in),
    assistant scores the 24 whose next token is the reply's."""
    write_prepared(tmp_path / "data", target)
    scored = {}
    for positions in ("assistant", "all"):
        train(config(tmp_path, "budget.max_steps=1", f"loss.positions={positions}", f"run_dir={tmp_path / positions}"),
              target=target)
        log = [json.loads(l) for l in (tmp_path / positions / "log.jsonl").read_text().splitlines()]
        scored[positions] = next(r["tokens"] for r in log if "tokens" in r)
    assert scored["assistant"] % 24 == 0 and scored["all"] == scored["assistant"] // 24 * 28
    with pytest.raises(TrainError, match="loss.positions 'some': expected assistant or all"):
        train(config(tmp_path, "budget.max_steps=1", "loss.positions=some"), target=target)


def test_validation_reads_the_features_as_drafting_does(tmp_path, target):
    """The training noise stays out of validation: at lr 0 the same head validates alike whatever loss.noise is."""
    write_prepared(tmp_path / "data", target)
    val = {}
    for noise in ("0.0", "5.0"):
        train(config(tmp_path, "budget.max_steps=1", "optim.lr=0", f"loss.noise={noise}",
                     f"run_dir={tmp_path / noise}"), target=target)
        log = [json.loads(l) for l in (tmp_path / noise / "log.jsonl").read_text().splitlines()]
        val[noise] = [r["val_loss"] for r in log if "val_loss" in r]
    assert val["0.0"] and val["0.0"] == val["5.0"]


def test_missing_data_and_missing_budget_are_one_line_errors(tmp_path, target):
    with pytest.raises(TrainError, match="set a budget"):
        train(config(tmp_path), target=target)
    with pytest.raises(TrainError, match="does not exist: run `eagle prep"):
        train(config(tmp_path, "budget.max_steps=1"), target=target)
    with pytest.raises(TrainError, match="data.feature_dtype .half.: expected auto or one of float32, bfloat16, float16"):
        train(config(tmp_path, "budget.max_steps=1", "data.feature_dtype=half"), target=target)


def test_16_bit_feature_cache(tmp_path, target, monkeypatch):
    """data.feature_dtype=bfloat16 keeps the cached features in 16 bits; the store is made from a float32 store of
    the same rows when there is one (not computed again), and training (float32 batches) still learns from it."""
    import train.features as loop
    from eagle.features import FeatureStore, features_dir
    from train.data import load_rows

    write_prepared(tmp_path / "data", target)
    layers = [0, 1, 2]
    rows = load_rows(config(tmp_path), "train", str(tmp_path / "data"))
    lengths = [len(r[0]) for r in rows]
    eagle3 = ("model.head_type=eagle3", "model.feature_layers=[0,1,2]", "loss.steps=2", "model.draft_vocab=40")
    train(config(tmp_path, "budget.max_steps=1", "run_dir=" + str(tmp_path / "a"), *eagle3), target=target)
    f32 = FeatureStore.open(features_dir(tmp_path / "data", "train", target, layers), lengths)
    monkeypatch.setattr(loop, "target_features", None)  # the float32 store is converted, not computed again
    train(config(tmp_path, "budget.max_steps=40", "data.feature_dtype=bfloat16", "optim.lr=1e-2", *eagle3),
          target=target)
    bf16 = FeatureStore.open(features_dir(tmp_path / "data", "train", target, layers, torch.bfloat16), lengths)
    assert bf16.dtype == torch.bfloat16 and bf16[0].dtype == torch.bfloat16 and bf16[0].shape == (lengths[0], 4 * 32)
    assert all(torch.equal(f32[i].to(torch.bfloat16), bf16[i]) for i in range(len(rows)))
    acc = [r["acc"] for r in map(json.loads, (tmp_path / "run/log.jsonl").read_text().splitlines()) if "acc" in r]
    assert sum(acc[-5:]) / 5 > sum(acc[:5]) / 5 + 0.2


def test_training_rows_identical_to_validation_rows_are_left_out(tmp_path, target, capsys):
    """Shards are split on their own, so a row repeated in another shard must not be trained on and scored."""
    def row(*ids):
        return torch.tensor(ids), torch.ones(len(ids), dtype=torch.bool)
    rows = [row(1, 2, 3), row(4, 5, 6), row(1, 2, 3, 4)]
    feats = [torch.zeros(3, 2), torch.ones(3, 2), torch.zeros(4, 2)]
    kept, kept_feats, left_out = drop_val_rows(rows, feats, [row(4, 5, 6)])
    assert left_out == 1 and [r[0].tolist() for r in kept] == [[1, 2, 3], [1, 2, 3, 4]]
    assert [f.shape for f in kept_feats] == [(3, 2), (4, 2)]
    same = drop_val_rows(rows, None, [row(7)])
    assert same[0] is rows and same[1:] == (None, 0)

    # a reworded prompt with the same reply: only the reply (mask) tokens are compared, as 8-grams
    def chat(prompt, reply):
        return (torch.tensor(prompt + reply),
                torch.tensor([False] * len(prompt) + [True] * len(reply)))
    reply = list(range(100, 120))  # 13 distinct 8-grams
    near = [chat([1, 2], reply), chat([1, 2, 3], reply[:14] + [7] * 6), chat([1, 2], reply[:12] + [7] * 8),
            chat([5], [9] * 20)]
    kept, _, left_out = drop_val_rows(near, None, [chat([1], reply)])
    assert left_out == 2 and [r[0].tolist()[:3] for r in kept] == [[1, 2, 100], [5, 9, 9]]  # 7 of 13 shared: out
    assert drop_val_rows(near, None, [chat([1], reply)], max_shared=2.0)[2] == 0

    write_prepared(tmp_path / "data", target)
    extra = tmp_path / "extra"
    extra.mkdir()
    first_train_row = (tmp_path / "data/train.jsonl").read_text().splitlines()[0]
    (extra / "train.jsonl").write_text((tmp_path / "data/val.jsonl").read_text() + first_train_row + "\n")
    train(config(tmp_path, "budget.max_steps=1", f"data.extra=[{extra}]"), target=target)
    assert "left out 4 training rows that repeat a validation row" in capsys.readouterr().out


def test_unrolled_steps_see_what_drafting_sees():
    """Step s of the training-time unroll at position p equals drafting s tokens after the true pairs < p-s+2."""
    from tiny import tiny_head

    from eagle import HeadCache
    from train.losses import unrolled_mask

    t = tiny_target()
    head = tiny_head(t)
    torch.manual_seed(0)
    T = 9
    feats = torch.randn(1, T, 32, dtype=torch.float64)
    ids = torch.randint(4, 90, (1, T + 1))
    pos = torch.arange(T)[None]
    cache = HeadCache()
    preds = [head(feats, ids[:, 1:], pos, cache=cache)]
    for s in (2, 3):
        x = torch.cat([torch.zeros_like(preds[-1][:, :1]), preds[-1][:, :-1]], dim=1)
        preds.append(head(x, ids[:, 1:], pos, cache=cache, mask=unrolled_mask(T, s)))
    p = 6
    with torch.no_grad():
        c = HeadCache()
        h = head(feats[:, : p - 1], ids[:, 1:p], pos[:, : p - 1], cache=c)[:, -1:]  # true pairs 0..p-2
        for q in (p - 1, p):  # two drafted steps: positions p-1 and p
            h = head(h, ids[:, q + 1: q + 2], torch.tensor([[q]]), cache=c)
    torch.testing.assert_close(preds[2][0, p], h[0, 0])
    assert unrolled_mask(4, 2).int().tolist() == [[0, 0, 0, 0, 1, 0, 0, 0], [1, 0, 0, 0, 0, 1, 0, 0],
                                                  [1, 1, 0, 0, 0, 0, 1, 0], [1, 1, 1, 0, 0, 0, 0, 1]]


@pytest.mark.parametrize("overrides", [
    ("model.head_type=eagle3", "model.feature_layers=[0,1,2]", "loss.steps=3"),
    ("data.online=true",),
    ("model.head_type=eagle3", "model.feature_layers=[1,2,2]", "loss.steps=2", "data.online=true"),
    ("model.head_type=eagle3", "model.feature_layers=[0,1,2]", "loss.steps=4", "loss.unroll_fraction=0.3"),
    ("model.head_type=eagle3", "model.feature_layers=[0,1,2]", "loss.steps=3", "model.fc_norm=true",
     "model.norm_output=true"),  # EAGLE-3.1
])
def test_eagle3_and_online_training_learn(tmp_path, target, overrides):
    """Top-1 agreement with the target rises (EAGLE-3's CE alone cannot fall below the entropy of p, which is
    high for a random tiny target, so the loss is not the measure here)."""
    from eagle.head import Eagle3Head

    write_prepared(tmp_path / "data", target)
    state = train(config(tmp_path, "budget.max_steps=50", "model.draft_vocab=40", "optim.lr=1e-2", *overrides),
                  target=target)
    log = [json.loads(l) for l in (tmp_path / "run/log.jsonl").read_text().splitlines()]
    acc = [r["acc"] for r in log if "acc" in r]
    assert state.done and sum(acc[-5:]) / 5 > sum(acc[:5]) / 5 + 0.2
    head = EagleHead.from_pretrained(tmp_path / "head").attach(target)
    assert isinstance(head, Eagle3Head) == ("model.head_type=eagle3" in overrides)
    assert (head.config.fc_norm, head.config.norm_output) == (("model.fc_norm=true" in overrides,) * 2)
    online = "data.online=true" in overrides
    assert online == (not list((tmp_path / "data").glob("features-*")))  # online runs cache nothing


def test_eagle3_unrolled_steps_see_what_drafting_sees():
    """The training-time test for EAGLE-3: step s reads the head's own hidden states, exactly as drafting does."""
    from test_eagle3 import eagle3_head

    from eagle import HeadCache
    from train.losses import unrolled_mask

    t = tiny_target()
    head = eagle3_head(t)
    torch.manual_seed(0)
    T = 9
    feats = torch.randn(1, T, 3 * 32, dtype=torch.float64)
    ids = torch.randint(4, 90, (1, T + 1))
    pos = torch.arange(T)[None]
    cache = HeadCache()
    preds = [head(feats, ids[:, 1:], pos, cache=cache)]
    for s in (2, 3):
        x = torch.cat([torch.zeros_like(preds[-1][:, :1]), preds[-1][:, :-1]], dim=1)
        preds.append(head(x, ids[:, 1:], pos, cache=cache, mask=unrolled_mask(T, s)))
    p = 6
    with torch.no_grad():
        c = HeadCache()
        h = head(feats[:, : p - 1], ids[:, 1:p], pos[:, : p - 1], cache=c)[:, -1:]
        for q in (p - 1, p):
            h = head(h, ids[:, q + 1: q + 2], torch.tensor([[q]]), cache=c)
    torch.testing.assert_close(preds[2][0, p], h[0, 0])


@pytest.mark.parametrize("kind", ["eagle1", "eagle3"])
def test_sparse_unroll_equals_the_dense_one_along_its_chains(kind):
    """`loss.unroll_fraction` < 1: steps 2.. run only along chains from a few start positions, and give exactly
    what the dense training-time test gives at those positions."""
    from test_eagle3 import eagle3_head
    from tiny import tiny_head

    from train.losses import chain_starts, unrolled

    t = tiny_target()
    head = tiny_head(t) if kind == "eagle1" else eagle3_head(t)
    torch.manual_seed(0)
    T, steps = 11, 4
    feats = torch.randn(2, T, 32 if kind == "eagle1" else 3 * 32, dtype=torch.float64)
    ids = torch.randint(4, 90, (2, T + 1))
    starts = torch.tensor([0, 3, 7])  # the last start that fits: T - steps
    dense = list(unrolled(head, feats, ids[:, 1:], steps))
    sparse = list(unrolled(head, feats, ids[:, 1:], steps, starts))
    assert [s for s, _, _ in sparse] == [1, 2, 3, 4]
    assert sparse[-1][2].tolist() == [3, 6, 10]
    for (_, want, _), (_, got, q) in zip(dense, sparse):
        torch.testing.assert_close(got, want[:, q])
    g = torch.Generator().manual_seed(0)
    assert chain_starts(T, steps, 1.0, g) is None and chain_starts(T, 1, 0.5, g) is None
    got = chain_starts(T, steps, 0.5, g)
    assert len(got) == 6 and got.tolist() == sorted(set(got.tolist())) and got.max() <= T - steps


def test_unroll_fraction_out_of_range_and_validation_only_at_the_end(tmp_path, target):
    write_prepared(tmp_path / "data", target, rows=8)
    with pytest.raises(TrainError, match=r"loss.unroll_fraction 0.0: expected a fraction in \(0, 1\]"):
        train(config(tmp_path, "budget.max_steps=1", "loss.unroll_fraction=0"), target=target)
    train(config(tmp_path, "budget.max_steps=4", "eval.every_minutes=0", "loss.steps=3", "loss.unroll_fraction=0.3"),
          target=target)
    log = [json.loads(l) for l in (tmp_path / "run/log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in log if "val_loss" in r] == [4]  # every_minutes=0: once, at the end


def test_simulated_chain_on_a_hand_checked_row():
    """Indices 0-1 are prompt, 2-9 reply (scored[j]: token j + 2 is the reply's). The reply's first token is the
    target's, so rounds start at index 3: drafts 1-2 agree there (ok[3, 0], ok[4, 1]), the third does not; the next
    round starts at 6 and fails at once; the round at 7 accepts one; the round at 9 is cut by the reply's end."""
    from train.validate import simulate_chain

    scored = torch.tensor([False, False] + [True] * 8)
    ok = torch.zeros(10, 3, dtype=torch.bool)
    ok[3, 0] = ok[4, 1] = True
    ok[7, 0] = True
    ok[9, 0] = ok[9, 1] = True  # a second draft at index 10 would leave the row
    assert simulate_chain(ok, scored) == [2, 0, 1, 1]


def test_simulated_acceptance_is_what_decoding_accepts(tmp_path, target, monkeypatch):
    """Along rows the target wrote greedily, the simulated rounds are the decoder's rounds on their prompts."""
    from infer import SpeculativeDecoder
    from train.data import load_rows
    from train.features import cached_features
    from train.validate import simulated_accepts

    # the simulation drafts in float32; decoding's int8 / bfloat16 drafts (`kernels.draft_precision`) can flip a
    # near tie of this tiny random model's draft logits, so they are compared in float32 here
    force_switches(monkeypatch, low_precision_drafts=False)

    write_prepared(tmp_path / "data", target, rows=12)
    train(config(tmp_path, "budget.max_steps=60", "eval.num_speculative_tokens=3"), target=target)
    head = EagleHead.from_pretrained(tmp_path / "head").attach(target)
    cfg = config(tmp_path)
    rows = load_rows(cfg, "train", str(tmp_path / "data"))
    feats = cached_features(target, rows, tmp_path / "data", "train")
    sim = simulated_accepts(head, target, rows, feats, 3, 256)
    dec = SpeculativeDecoder(target, head)
    checked = 0
    for (ids, mask), accepts in zip(rows, sim):
        out = dec.generate(ids[:6].tolist(), 24, num_speculative_tokens=3)
        assert out.token_ids == ids[6:].tolist()
        # every round but the last, which max_new_tokens may cut short
        assert out.accept_lengths[:-1] == accepts[: len(out.accept_lengths) - 1]
        checked += sum(accepts)
    assert checked > 10  # the head accepts something, so the comparison is not all zeros


def test_extra_rows_first_then_the_prepared_ones(tmp_path, target):
    """`data.order=extra_first`: each epoch trains on every data.extra row (e.g. raw rows) before the prepared ones,
    and a batch never mixes them; `mixed` shuffles them together."""
    from train.data import load_data, make_batches, row_groups

    write_prepared(tmp_path / "data", target)
    write_prepared(tmp_path / "extra", target, rows=16, seed=1)
    cfg = config(tmp_path, f"data.extra={tmp_path / 'extra'}", "data.order=extra_first", "budget.max_steps=6")
    data = load_data(cfg, target)
    assert sorted(data.sources) == [0] * 20 + [1] * 12  # 4 rows of each held out as validation rows
    lengths = [r[0].shape[0] for r in data.rows]
    for epoch in range(2):
        batches = make_batches(lengths, 64, torch.Generator().manual_seed(epoch), row_groups(cfg, data))
        tags = [{data.sources[i] for i in b} for b in batches]
        assert all(len(t) == 1 for t in tags)  # no batch mixes the two
        first = [t.pop() for t in tags]
        assert first == sorted(first, reverse=True)  # extra rows (1) first, then the prepared (0)
        assert sorted(i for b in batches for i in b) == list(range(32))
    mixed = config(tmp_path, f"data.extra={tmp_path / 'extra'}", "budget.max_steps=6")
    assert row_groups(mixed, data) is None
    assert train(cfg, target=target).step == 6
    with pytest.raises(TrainError, match="data.order 'raw': expected mixed or extra_first"):
        train(config(tmp_path, "data.order=raw", "budget.max_steps=1"), target=target)


def test_cross_entropy_against_the_top_token(tmp_path, target):
    """`loss.ce_target=argmax`: the cross-entropy scores p's top token alone; the head still learns it."""
    write_prepared(tmp_path / "data", target)
    train(config(tmp_path, "budget.max_steps=40", "loss.ce_target=argmax", "loss.ce_weight=1.0"), target=target)
    acc = [r["acc"] for r in map(json.loads, (tmp_path / "run/log.jsonl").read_text().splitlines()) if "acc" in r]
    assert sum(acc[-5:]) / 5 > sum(acc[:5]) / 5 + 0.2
    with pytest.raises(TrainError, match="loss.ce_target 'q': expected p or argmax"):
        train(config(tmp_path, "loss.ce_target=q", "budget.max_steps=1"), target=target)


def test_feature_pass_in_bfloat16_for_rows_without_features(tmp_path, target):
    """`data.feature_pass=bfloat16`: rows the target left features for (prep's, from regeneration) keep those exact
    ones; rows with none (raw rows) get a bfloat16 copy's, stored under that copy's identity, never the target's;
    held-out rows always the target's own; `target` computes them all with the target itself; `auto` is bfloat16
    where the CPU multiplies it natively."""
    from eagle.device import native_bfloat16
    from eagle.features import FeatureStore, features_dir
    from train.data import load_data, load_rows
    from train.features import batch_features, cached_features, feature_pass_target

    write_prepared(tmp_path / "data", target)
    write_prepared(tmp_path / "extra", target, rows=16, seed=1)
    base = config(tmp_path)
    own = cached_features(target, load_rows(base, "train", str(tmp_path / "data")), tmp_path / "data", "train")
    cfg = config(tmp_path, f"data.extra={tmp_path / 'extra'}", "data.feature_pass=bfloat16", "budget.max_steps=3")
    copy = feature_pass_target(cfg, target)()
    assert copy.dtype == torch.bfloat16 and copy.identity != target.identity and target.dtype == torch.float32
    data = load_data(cfg, target)
    assert sorted(data.sources) == [0] * 20 + [1] * 12
    # a pass over rows batched by length sums in another order than a one-row pass where the host's measured product
    # layouts differ by row count (float32 rounding, ~1e-7 here); a bfloat16 copy's features differ by ~1e-2
    def same_float32(a, b):
        return torch.allclose(a.float(), b, rtol=1e-5, atol=1e-5)

    for i, (ids, _) in enumerate(data.val_rows):  # held-out rows: the target's own, for an exact simulated tau
        assert same_float32(data.val_feats[i], batch_features(target, ids[None])[0])
    for i, (ids, _) in enumerate(data.rows):
        if data.sources[i] == 0:  # prep's own features, as stored
            assert torch.equal(data.feats[i], own[i])
        else:  # the bfloat16 copy's: close to, not equal to, the float32 target's own
            exact = batch_features(target, ids[None])[0]
            assert not same_float32(data.feats[i], exact)
            assert data.feats[i].dtype == torch.bfloat16  # stored in the copy's dtype
            assert torch.nn.functional.cosine_similarity(data.feats[i].float(), exact, dim=-1).min() > 0.99
    lengths = [r[0].shape[0] for r in load_rows(cfg, "train", str(tmp_path / "extra"))]
    assert FeatureStore.open(features_dir(tmp_path / "extra", "train", copy, dtype=torch.bfloat16), lengths) is not None
    assert FeatureStore.open(features_dir(tmp_path / "extra", "train", target), lengths) is None
    assert train(cfg, target=target).step > 0  # and it trains on them
    # `target`: the extra rows' features from the target itself
    exact = load_data(config(tmp_path, f"data.extra={tmp_path / 'extra'}"), target)
    i = data.sources.index(1)
    assert same_float32(exact.feats[i], batch_features(target, exact.rows[i][0][None])[0])
    auto = feature_pass_target(config(tmp_path, "data.feature_pass=auto"), target)
    assert (auto is not None) == native_bfloat16(target.device)
    assert feature_pass_target(config(tmp_path, "data.feature_pass=bfloat16"), copy) is None  # already bfloat16
    with pytest.raises(TrainError, match="data.feature_pass 'fp8': expected target, bfloat16 or auto"):
        train(config(tmp_path, "data.feature_pass=fp8", "budget.max_steps=1"), target=target)


def test_validation_reports_the_share_of_target_tokens_in_the_draft_vocabulary(tmp_path, target):
    """val_in_vocab: of the held-out reply tokens (the target's own greedy tokens, so its argmax at every scored
    position), the share the reduced draft vocabulary holds; a first draft can be accepted only there."""
    write_prepared(tmp_path / "data", target)
    train(config(tmp_path, "budget.max_steps=2", "model.draft_vocab=40", "loss.positions=assistant"), target=target)
    d2t = EagleHead.from_pretrained(tmp_path / "head").d2t
    val = [json.loads(l) for l in (tmp_path / "data/val.jsonl").read_text().splitlines()]
    reply = torch.tensor([t for r in val for t, m in zip(r["input_ids"], r["loss_mask"]) if m])
    want = torch.isin(reply, d2t).float().mean().item()
    log = [json.loads(l) for l in (tmp_path / "run/log.jsonl").read_text().splitlines()]
    assert 0 < want < 1
    assert [r["val_in_vocab"] for r in log if "val_in_vocab" in r] == [pytest.approx(want)]


def test_log_acceptance_loss(tmp_path, target):
    """`loss.divergence=lk`: the distribution term is -log sum_x min(p, q), the log of the acceptance rate sampled
    verification would give (LK losses); training on it raises that rate, and the head learns p's top token."""
    write_prepared(tmp_path / "data", target)
    train(config(tmp_path, "budget.max_steps=40", "loss.divergence=lk", "loss.ce_weight=1.0"), target=target)
    log = [json.loads(l) for l in (tmp_path / "run/log.jsonl").read_text().splitlines()]
    alpha = [math.exp(-r["ce"]) for r in log if "ce" in r]
    acc = [r["acc"] for r in log if "acc" in r]
    assert all(0 < a <= 1 for a in alpha)
    assert sum(alpha[-5:]) / 5 > sum(alpha[:5]) / 5 + 0.1
    assert sum(acc[-5:]) / 5 > sum(acc[:5]) / 5 + 0.03  # (the tiny random target's p is flat: 0.02 -> 0.08)
    with pytest.raises(TrainError, match="loss.divergence 'tv': expected kl or lk"):
        train(config(tmp_path, "loss.divergence=tv", "budget.max_steps=1"), target=target)
    with pytest.raises(TrainError, match="loss.divergence lk compares q with the whole of p; loss.ce_target 'argmax'"):
        train(config(tmp_path, "loss.divergence=lk", "loss.ce_target=argmax", "budget.max_steps=1"), target=target)


@pytest.mark.parametrize("kind", ["eagle1", "eagle3"])
def test_residual_dropout_drops_only_while_training(kind):
    """`set_dropout(p, gen)`: in training mode a share p of each residual branch's entries is zeroed (the rest
    scaled by 1 / (1 - p)), the masks drawn from `gen` alone; in eval mode (validation, drafting) nothing changes."""
    from test_eagle3 import eagle3_head
    from tiny import tiny_head

    head = (eagle3_head if kind == "eagle3" else tiny_head)(tiny_target()).eval()
    torch.manual_seed(0)
    width = 32 * (3 if kind == "eagle3" else 1)
    feats, ids, pos = torch.randn(2, 7, width, dtype=torch.float64), torch.randint(4, 90, (2, 7)), torch.arange(7)[None]
    plain = head(feats, ids, pos)
    head.set_dropout(0.5, torch.Generator().manual_seed(3))
    torch.testing.assert_close(head(feats, ids, pos), plain)  # eval mode: no dropout
    head.train()
    a = head(feats, ids, pos)
    head.set_dropout(0.5, torch.Generator().manual_seed(3))
    torch.testing.assert_close(head(feats, ids, pos), a)  # the same generator, the same masks
    assert not torch.allclose(a, plain)
    drop = head.layers[0].dropout
    drop.gen = torch.Generator().manual_seed(1)
    y = drop(torch.ones(100_000, dtype=torch.float64))
    assert set(y.unique().tolist()) == {0.0, 2.0} and abs(y.mean().item() - 1.0) < 0.02
    head.set_dropout(0.0)
    torch.testing.assert_close(head(feats, ids, pos), plain)
    with pytest.raises(ValueError, match="dropout 1.0: expected 0 <= p < 1"):
        head.set_dropout(1.0)


def test_training_with_dropout_learns_and_repeats_exactly(tmp_path, target):
    write_prepared(tmp_path / "data", target)
    runs = [train(config(tmp_path, "budget.max_steps=30", f"optim.dropout={p}", f"run_dir={tmp_path / r}",
                         f"out={tmp_path / r / 'head'}"), target=target) for r, p in (("a", 0.3), ("b", 0.3), ("c", 0))]
    assert [r.step for r in runs] == [30, 30, 30]
    log = [json.loads(l) for l in (tmp_path / "a/log.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in log if "loss" in r]
    assert sum(losses[-5:]) / 5 < 0.85 * sum(losses[:5]) / 5
    a = EagleHead.from_pretrained(tmp_path / "a/head").trainable_state_dict()
    b = EagleHead.from_pretrained(tmp_path / "b/head").trainable_state_dict()
    c = EagleHead.from_pretrained(tmp_path / "c/head").trainable_state_dict()
    for k in a:
        torch.testing.assert_close(a[k], b[k])
    assert not torch.allclose(a["fc.weight"], c["fc.weight"])  # the dropout was applied
