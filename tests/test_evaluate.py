"""`eagle eval` on a tiny model: report fields, prompt formats, and one-line errors."""

import json

import pytest
from tiny import tiny_head, tiny_target

from infer import DecodeConfig, SpeculativeDecoder
from infer.evaluate import EvalConfig, EvalError, acceptance_per_position, evaluate, load_prompts


def test_prompt_formats(tmp_path):
    f = tmp_path / "p.jsonl"
    rows = [{"question_id": 7, "category": "math", "turns": ["w1 w2", "second"]},
            {"messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "w3"}]},
            {"conversations": [{"from": "human", "value": "w4"}]}, {"prompt": "w5"}, {"other": 1}]
    f.write_text("\n".join(json.dumps(r) for r in rows))
    got = load_prompts(str(f), 10)
    assert [p["prompt"] for p in got] == ["w1 w2", "w3", "w4", "w5"]
    assert got[0]["question_id"] == 7 and got[0]["category"] == "math" and got[1]["category"] == "all"
    assert len(load_prompts(str(f), 2)) == 2
    assert [p["prompt"] for p in load_prompts(str(f), 2, spread=True)] == ["w1 w2", "w4"]
    assert len(load_prompts(str(f), 10, spread=True)) == 4
    with pytest.raises(EvalError, match="does not exist"):
        load_prompts(str(tmp_path / "missing.jsonl"), 3)
    (tmp_path / "bad.jsonl").write_text('{"turns": ["a"]}\n{oops\n')
    with pytest.raises(EvalError, match="line 2 is not valid JSON"):
        load_prompts(str(tmp_path / "bad.jsonl"), 3)


def test_acceptance_per_position():
    assert acceptance_per_position([0, 2, 4, 1], 4) == [0.75, 0.5, 0.25, 0.25]


def test_report_has_every_field(tmp_path):
    t = tiny_target()
    f = tmp_path / "p.jsonl"
    f.write_text("\n".join(json.dumps({"question_id": i, "category": c, "turns": [f"w{i} w{i + 1} w{i + 2}"]})
                           for i, c in enumerate(["a", "b", "a"])))
    dec = SpeculativeDecoder(t, tiny_head(t))
    cfg = EvalConfig(target="tiny", draft="random", data=str(f), out=str(tmp_path / "ev"), num_prompts=3,
                     decode=DecodeConfig(max_new_tokens=12, num_speculative_tokens=3))
    r = evaluate(cfg, decoder=dec)
    saved = json.loads((tmp_path / "ev/report.json").read_text())
    for key in ("tau", "acceptance_per_position", "baseline_tokens_per_s", "spec_tokens_per_s", "speedup",
                "lossless", "prompts", "per_category"):
        assert key in saved
    assert saved["lossless"] == 1.0 and len(saved["acceptance_per_position"]) == 3
    assert set(saved["per_category"]) == {"a", "b"}
    p = saved["prompts"][0]
    assert p["baseline_token_ids"] == p["spec_token_ids"] and p["question_id"] == 0
    for key in ("prompt_token_ids", "accept_lengths", "category"):
        assert key in p
    assert (tmp_path / "ev/report.md").read_text().startswith("# Speculative decoding")
    for key in ("draft", "verify", "other"):
        assert saved["round_ms"][key] >= 0
    assert r["tau"] == pytest.approx((sum(sum(q["accept_lengths"]) for q in saved["prompts"])
                                      + sum(len(q["accept_lengths"]) for q in saved["prompts"]))
                                     / sum(len(q["accept_lengths"]) for q in saved["prompts"]))


@pytest.mark.parametrize("decode,depth", [
    (dict(mode="dynamic", top_k=3, depth=4, total_tokens=8), 4),
    (dict(mode="static", tree="[[0], [1], [0, 0], [0, 0, 0]]"), 3),
    (dict(mode="chain", num_speculative_tokens=2, temperature=0.8, seed=1), 2),
])
def test_eval_modes_record_their_settings(tmp_path, decode, depth):
    t = tiny_target()
    f = tmp_path / "p.jsonl"
    f.write_text(json.dumps({"turns": ["w1 w2 w3"]}) + "\n" + json.dumps({"turns": ["w4 w5"]}))
    dec = SpeculativeDecoder(t, tiny_head(t))
    cfg = EvalConfig(target="tiny", data=str(f), out=str(tmp_path / "ev"), num_prompts=2,
                     decode=DecodeConfig(max_new_tokens=10, **decode))
    r = evaluate(cfg, decoder=dec)
    assert len(r["acceptance_per_position"]) == depth
    assert r["settings"]["decode"]["mode"] == decode["mode"]
    assert r["lossless"] == (None if decode.get("temperature") else 1.0)
    assert "mode " + decode["mode"] in (tmp_path / "ev/report.md").read_text()


def test_report_png_is_drawn_with_matplotlib(tmp_path):
    pytest.importorskip("matplotlib")
    from infer.evaluate import plot

    r = {"acceptance_per_position": [0.6, 0.3, 0.1], "tau": 2.0, "spec_tokens_per_s": 30.0,
         "baseline_tokens_per_s": 20.0, "speedup": 1.5, "prompts": [{"accept_lengths": [0, 1, 3, 2]}]}
    assert plot(r, tmp_path / "r.png")
    assert (tmp_path / "r.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_eval_cli_takes_tree_options(tmp_path):
    from eagle_cli import _config_from_args, build_parser

    args = build_parser().parse_args(["eval", "--data", "x.jsonl", "--mode", "dynamic", "--top-k", "3", "--depth",
                                      "5", "--total-tokens", "10", "--temperature", "0.7", "--no-fast-path"])
    cfg = _config_from_args(EvalConfig, args)
    assert (cfg.decode.mode, cfg.decode.top_k, cfg.decode.depth, cfg.decode.total_tokens) == ("dynamic", 3, 5, 10)
    assert cfg.decode.temperature == 0.7 and cfg.cpu.fast_path is False and cfg.data == "x.jsonl"


def test_speedup_is_the_median_of_per_prompt_ratios():
    """Another job on the cores during a few prompts' plain runs moves the aggregate, not the median."""
    from infer.decoder import GenerateOutput
    from infer.evaluate import _summary, speedup_spread

    def run(tokens, seconds):
        return GenerateOutput(token_ids=[1] * tokens, text="", prompt_len=3, accept_lengths=[1], total_s=seconds)

    pairs = [(run(100, 10.0), run(100, 8.0)) for _ in range(7)]  # 1.25x each
    pairs += [(run(400, 400.0), run(10, 1.0))]  # a long plain run slowed 10x by another job: 10x on its own
    median, quartiles = speedup_spread(pairs)
    assert median == pytest.approx(1.25) and quartiles == [pytest.approx(1.25), pytest.approx(1.25)]
    s = _summary(pairs, 1)
    assert s["speedup"] == pytest.approx(1.25) and s["speedup_aggregate"] > 4  # the slowed plain run weighs most
