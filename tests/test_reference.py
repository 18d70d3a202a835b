"""The independent reference (`infer.reference`, `eagle eval --reference hf`): stock transformers' greedy tokens from
a model the engine never touched, so a bug the engine shares with its own plain decoding still shows."""

import json

import pytest
import torch
from paths import force_switches
from tiny import tiny_head, tiny_target

from infer import DecodeConfig, SpeculativeDecoder
from infer.evaluate import EvalConfig, EvalError, evaluate
from infer.reference import HFReference, ReferenceOutput, first_mismatch


def _eval(tmp_path, dec, reference, **decode):
    f = tmp_path / "p.jsonl"
    f.write_text("\n".join(json.dumps({"question_id": i, "turns": [f"w{i} w{i + 3} w{2 * i + 1}"]}) for i in range(4)))
    cfg = EvalConfig(target="tiny", data=str(f), out=str(tmp_path / "ev"), num_prompts=4, reference="hf",
                     decode=DecodeConfig(max_new_tokens=16, num_speculative_tokens=3, **decode))
    return evaluate(cfg, decoder=dec, reference=reference)


def test_eval_reports_lossless_against_the_reference(tmp_path):
    engine, reference = tiny_target(), HFReference(tiny_target())  # the same weights, two separate models
    r = _eval(tmp_path, SpeculativeDecoder(engine, tiny_head(engine)), reference)
    assert r["lossless"] == r["lossless_vs_reference"] == r["baseline_vs_reference"] == 1.0
    for p in r["prompts"]:
        assert p["spec_mismatch"] is None and p["reference_token_ids"] == p["spec_token_ids"]
    saved = json.loads((tmp_path / "ev/report.json").read_text())
    assert saved["lossless_vs_reference"] == 1.0 and saved["per_category"]["all"]["lossless_vs_reference"] == 1.0
    assert "| vs reference |" in (tmp_path / "ev/report.md").read_text()


def test_a_bug_shared_with_the_engines_own_baseline_shows_only_against_the_reference(tmp_path):
    engine, reference = tiny_target(), HFReference(tiny_target())
    with torch.no_grad():  # a wrong scale in every pass the engine makes, plain and speculative alike
        engine.model.model.layers[1].mlp.down_proj.weight.mul_(3.0)
    r = _eval(tmp_path, SpeculativeDecoder(engine, tiny_head(engine)), reference)
    assert r["lossless"] == 1.0  # the engine against itself sees nothing
    assert r["lossless_vs_reference"] < 1.0 and r["baseline_vs_reference"] < 1.0
    bad = [p for p in r["prompts"] if p["spec_mismatch"] is not None]
    m = bad[0]["spec_mismatch"]
    assert m["ours"] == bad[0]["spec_token_ids"][m["position"]] != m["reference"]
    assert m["margin"] > 0  # the reference's top-1 over top-2 logit there
    assert "differs from the reference at new token" in (tmp_path / "ev/report.md").read_text()


def test_first_mismatch_names_the_position_tokens_and_margin():
    ref = ReferenceOutput([5, 6, 7], [1.0, 0.5, 0.25])
    assert first_mismatch([5, 6, 7], ref) is None
    m = first_mismatch([5, 9, 7], ref)
    assert (m.position, m.ours, m.reference, m.margin) == (1, 9, 6, 0.5)
    m = first_mismatch([5, 6], ref)  # ours ended first
    assert (m.position, m.ours, m.reference) == (2, None, 7)
    m = first_mismatch([5, 6, 7, 8], ref)  # the reference ended first
    assert (m.position, m.ours, m.reference, m.margin) == (3, 8, None, None)


def test_reference_settings_that_cannot_work_are_one_line_errors(tmp_path):
    t = tiny_target()
    dec = SpeculativeDecoder(t, tiny_head(t))
    with pytest.raises(EvalError, match="needs --temperature 0"):
        _eval(tmp_path, dec, HFReference(t), temperature=0.7)
    f = tmp_path / "p.jsonl"
    f.write_text(json.dumps({"turns": ["w1"]}))
    with pytest.raises(EvalError, match="--reference 'vllm': expected hf"):
        evaluate(EvalConfig(target="tiny", data=str(f), reference="vllm"), decoder=dec)


# -- SmolLM2 on every CPU path --------------------------------------------------------------------------------------
LONG_PROMPT = ("Read this note and answer the question after it. The town of Alder sits between two rivers, the "
               "Wend and the Sorrow. Its market opens at dawn on Tuesdays and Fridays, and its bridge, rebuilt in "
               "1894 after a flood, is the only crossing for twenty miles. The baker, Mara, sells rye bread and "
               "honey cakes; the smith, Oren, shoes horses and mends ploughs. Question: on which days can a "
               "traveller buy honey cakes in Alder, and why might they have to cross the bridge to do so?")


@pytest.fixture(scope="module")
def smollm2():
    from eagle import load_target

    return load_target("smollm2-135m")


@pytest.fixture(scope="module")
def smollm2_reference(smollm2):
    """Transformers' greedy tokens for LONG_PROMPT, from a second SmolLM2 loaded on its own."""
    ids = SpeculativeDecoder(smollm2, None).encode(LONG_PROMPT)
    assert len(ids) > 64  # more than one prefill chunk of the fast path (eagle.attention.MAX_ROWS)
    return ids, HFReference.load("smollm2-135m").greedy(ids, 48, smollm2.eos_ids).token_ids


@pytest.mark.smollm
def test_smollm2_greedy_and_speculative_equal_transformers_on_every_cpu_path(kernel_path, smollm2,
                                                                              smollm2_reference):
    """The chunked prefill of a long prompt and the decoding after it, plain and with a random head (chain and
    dynamic tree), through the kernels of the path named in the test's id, give stock transformers' tokens."""
    from cpu_backend import kernels

    from eagle import EagleHead, HeadConfig
    from cpu_backend.fastpath import disable_fast_linear, enable_fast_linear
    from cpu_backend.plan import BUCKETS, Plan

    ids, want = smollm2_reference
    torch.manual_seed(0)
    head = EagleHead(HeadConfig.for_target(smollm2, draft_vocab_size=512)).attach(smollm2)
    head.set_draft_vocab(torch.arange(512) * 64)
    for model in (smollm2.model, head):  # the kernel for every product: the path under test, not a timing plan's pick
        enable_fast_linear(model, Plan(layouts={f"{m.weight.shape[0]}x{m.weight.shape[1]}": {b: "kernel" for b in BUCKETS}
                                               for m in model.modules() if isinstance(m, torch.nn.Linear)}))
    try:
        dec = SpeculativeDecoder(smollm2, head)
        assert dec.generate(ids, 48, speculative=False).token_ids == want
        q_proj = smollm2.model.model.layers[0].self_attn.q_proj.weight  # GGUF Q4_1: read as codes, on this path
        assert kernels.packed(q_proj) & 15 == {"fma": 1, "avx2": 1, "vnni": 9, "amx": 2}[kernel_path]
        assert dec.generate(ids, 48, num_speculative_tokens=3).token_ids == want
        assert dec.generate(ids, 48, mode="dynamic", top_k=2, depth=3, total_tokens=6).token_ids == want
    finally:
        for model in (smollm2.model, head):
            disable_fast_linear(model)


@pytest.mark.smollm
def test_two_timing_plans_route_smollm2_differently_and_give_the_same_tokens(smollm2, smollm2_reference):
    """A plan changes speed, never tokens: the kernel everywhere (each decoder layer in one C call), or the MLPs'
    down projections through F.linear (their layers then run module by module)."""
    from cpu_backend import kernels
    from cpu_backend.fastpath import disable_fast_linear, enable_fast_linear
    from cpu_backend.plan import BUCKETS, Plan

    if not kernels.available():
        pytest.skip("the C kernel does not build here")
    ids, want = smollm2_reference
    shapes = {f"{m.weight.shape[0]}x{m.weight.shape[1]}" for m in smollm2.model.modules()
              if isinstance(m, torch.nn.Linear)}
    down = smollm2.model.model.layers[0].mlp.down_proj.weight
    kernel = Plan(layouts={k: {b: "kernel" for b in BUCKETS} for k in shapes})
    mixed = Plan(layouts={k: {b: "linear" if k == "576x1536" else "kernel" for b in BUCKETS} for k in shapes})
    assert kernel.layout(down, 1) == "kernel" and mixed.layout(down, 1) == "linear"
    for plan, one_call in ((kernel, True), (mixed, False)):
        enable_fast_linear(smollm2.model, plan)
        try:
            assert smollm2.model.model.layers[0].cpu_plan.rows[1] == one_call  # a one-token pass's route
            assert SpeculativeDecoder(smollm2, None).generate(ids, 48, speculative=False).token_ids == want
        finally:
            disable_fast_linear(smollm2.model)


def test_a_timing_plan_is_keyed_by_the_kernel_path_and_measured_again_on_request(tmp_path, monkeypatch):
    from cpu_backend import kernels, plan

    if not kernels.available():
        pytest.skip("the C kernel does not build here")
    model = tiny_target(dtype=torch.float32).model
    keys = set()
    for amx, vnni in ((True, True), (False, True), (False, False)):
        force_switches(monkeypatch, amx=amx)
        force_switches(monkeypatch, vnni=vnni)
        keys.add(plan.cache_path(model, "passes"))
    assert len(keys) == 3  # EAGLE_NO_AMX / EAGLE_NO_VNNI plan apart
    made = []
    path = str(tmp_path / "plan.json")
    assert plan.cached_json(path, lambda: made.append(1) or {"a": 1}) == {"a": 1}
    assert plan.cached_json(path, lambda: made.append(1) or {"a": 2}) == {"a": 1} and len(made) == 1
    force_switches(monkeypatch, recalibrate=True)  # EAGLE_RECALIBRATE=1
    assert plan.cached_json(path, lambda: made.append(1) or {"a": 3}) == {"a": 3} and len(made) == 2
