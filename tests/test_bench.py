"""`eagle bench` on a tiny model: the candidates it measures, the report, the best setting's flags, and errors."""

import dataclasses
import json

import pytest
from tiny import tiny_head, tiny_target

from infer import DecodeConfig, SpeculativeDecoder
from infer.bench import BenchConfig, bench, candidates
from infer.evaluate import EvalError


def _prompts(tmp_path):
    f = tmp_path / "p.jsonl"
    f.write_text("\n".join(json.dumps({"turns": [f"w{i} w{i + 1} w{i} w{i + 1} w{i}"]}) for i in range(3)))
    return str(f)


def test_candidates_cover_the_sweep():
    cfg = BenchConfig(sweep_k=[1, 3], sweep_dynamic=["4:3:8"], sweep_lookup=[0, 5], sweep_lookup_adaptive=False)
    names = [c.name for c in candidates(cfg, has_head=True)]
    assert names == ["chain k=1", "chain k=3", "dynamic 4:3:8", "chain k=1 + lookup 5", "chain k=3 + lookup 5",
                     "dynamic 4:3:8 + lookup 5", "lookup 5 (no head)"]
    assert [c.name for c in candidates(cfg, has_head=False)] == ["lookup 5 (no head)"]
    dyn = candidates(cfg, has_head=True)[5]
    assert dyn.settings == dict(mode="dynamic", top_k=4, depth=3, total_tokens=8, prompt_lookup_num_tokens=5,
                                prompt_lookup_adaptive=False)
    # the head's drafts alone say so: a base config with lookup on must not leak into them
    assert candidates(cfg, has_head=True)[0].settings["prompt_lookup_num_tokens"] == 0
    # with adaptive lookups too: a twin of every lookup candidate, each saying which kind it is
    both = candidates(dataclasses.replace(cfg, sweep_k=[1], sweep_dynamic=[], sweep_lookup_adaptive=True), True)
    assert [c.name for c in both] == ["chain k=1", "chain k=1 + lookup 5", "lookup 5 (no head)",
                                      "chain k=1 + lookup 5, adaptive", "lookup 5, adaptive (no head)"]
    assert [c.settings["prompt_lookup_adaptive"] for c in both] == [False, False, False, True, True]
    assert [c.name for c in candidates(dataclasses.replace(cfg, sweep_lookup=[1], sweep_lookup_adaptive=True),
                                       has_head=False)] == ["lookup 1 (no head)"]  # adaptive within 1 .. 1: fixed


@pytest.mark.parametrize("bad,msg", [
    (dict(sweep_dynamic=["4:3"]), "sweep_dynamic '4:3': expected TOP_K:DEPTH:TOTAL_TOKENS"),
    (dict(sweep_k=[0]), "sweep_k 0"),
    (dict(sweep_lookup=[-1]), "sweep_lookup"),
    (dict(sweep_dynamic=["2:3:1"]), "total_tokens >= 2"),
])
def test_bad_sweeps_are_one_line_errors(bad, msg):
    with pytest.raises(ValueError, match=msg) as e:
        candidates(BenchConfig(**bad), has_head=True)
    assert "\n" not in str(e.value)


def test_without_a_head_and_without_lookup_there_is_nothing_to_measure():
    with pytest.raises(EvalError, match="nothing to measure"):
        candidates(BenchConfig(sweep_lookup=[0]), has_head=False)


def test_bench_measures_every_candidate_and_names_the_fastest_lossless_one(tmp_path):
    t = tiny_target()
    dec = SpeculativeDecoder(t, tiny_head(t))
    cfg = BenchConfig(target="tiny", draft="random", data=_prompts(tmp_path), out=str(tmp_path / "b"),
                      num_prompts=3, decode=DecodeConfig(max_new_tokens=10), sweep_k=[1, 2],
                      sweep_dynamic=["2:2:4"], sweep_lookup=[0, 3], prune_after=0)
    r = bench(cfg, decoder=dec)
    assert len(r.candidates) == 11 and r.num_prompts == 3 and all(c.prompts == 3 for c in r.candidates)
    speeds = [c.tokens_per_s for c in r.candidates]
    assert speeds == sorted(speeds, reverse=True)
    assert all(c.identical == 1.0 and c.tau >= 1.0 for c in r.candidates)  # every candidate is lossless
    fastest = r.candidates[0]
    assert r.best is (fastest if fastest.speedup > 1 else None)
    saved = json.loads((tmp_path / "b/bench.json").read_text())
    assert [c["name"] for c in saved["candidates"]] == [c.name for c in r.candidates]
    assert (tmp_path / "b/bench.md").read_text().startswith("# Fastest speculative setting")


def test_the_best_settings_flags_parse_back_to_the_same_config():
    from eagle_cli import _config_from_args, build_parser
    from infer.bench import flags

    for c in candidates(BenchConfig(sweep_k=[2], sweep_dynamic=["4:3:8"], sweep_lookup=[0, 8]), has_head=True):
        args = build_parser().parse_args(["generate", "--prompt", "x"] + flags(c.settings).split())
        assert _config_from_args(DecodeConfig, args) == dataclasses.replace(DecodeConfig(), **c.settings)


def test_bench_cli_takes_sweep_options():
    from eagle_cli import _config_from_args, build_parser

    args = build_parser().parse_args(["bench", "--data", "x.jsonl", "--sweep-k", "1,2", "--sweep-dynamic", "4:3:8",
                                      "--sweep-lookup", "8", "--max-new-tokens", "64", "--temperature", "0.5"])
    cfg = _config_from_args(BenchConfig, args)
    assert cfg.sweep_k == [1, 2] and cfg.sweep_dynamic == ["4:3:8"] and cfg.sweep_lookup == [8]
    assert cfg.decode.max_new_tokens == 64 and cfg.decode.temperature == 0.5


def test_bench_with_a_draft_model_sweeps_chains_only(tmp_path):
    t = tiny_target()
    dec = SpeculativeDecoder.from_pretrained(t, draft_model=tiny_target(seed=5))
    cfg = BenchConfig(target="tiny", draft_model="tiny-5", data=_prompts(tmp_path), out=str(tmp_path / "b"),
                      num_prompts=2, decode=DecodeConfig(max_new_tokens=8), sweep_k=[1, 2], sweep_lookup=[0])
    r = bench(cfg, decoder=dec)
    assert sorted(c.name for c in r.candidates) == ["chain k=1", "chain k=2"]
    assert all(c.identical == 1.0 for c in r.candidates)


def test_pruning_stops_the_slow_candidates_and_keeps_them_in_the_report(tmp_path):
    t = tiny_target()
    dec = SpeculativeDecoder(t, tiny_head(t))
    cfg = BenchConfig(target="tiny", draft="random", data=_prompts(tmp_path), out=str(tmp_path / "b"),
                      num_prompts=3, decode=DecodeConfig(max_new_tokens=10), sweep_k=[1, 2, 3],
                      sweep_dynamic=[], sweep_lookup=[0], prune_after=1, prune_below=1.0)  # only the fastest goes on
    r = bench(cfg, decoder=dec)
    assert [c.prompts for c in r.candidates] == [3, 1, 1]
    assert r.best in (r.candidates[0], None)
    assert "stopped there" in (tmp_path / "b/bench.md").read_text()
