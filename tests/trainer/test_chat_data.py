"""trainer/offline/chat_data.py: chat records as training samples, on the tiny model's real tokenizer and chat template.

What the mask covers is checked by decoding the masked tokens and comparing with the records' own message texts,
never with ids or offsets worked out the way the module does.
"""

from __future__ import annotations

import json

import pytest
from transformers import AutoTokenizer

from trainer.offline.chat_data import ChatDataError, chat_samples, read_chat_records

TOOLS = [{"type": "function", "function": {
    "name": "add", "description": "Add two numbers and say the sum",
    "parameters": {"type": "object", "properties": {"a": {"type": "number"}, "b": {"type": "number"}}}}}]
ARGUMENTS = {"a": 17, "b": 25}

# Drops the text of every assistant turn but the last: an earlier render is not a prefix of a later one.
DROPS_EARLIER_TURNS = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n"
    "{% if m.role == 'assistant' and not loop.last %}(an earlier reply){% else %}{{ m.content }}{% endif %}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    return AutoTokenizer.from_pretrained(tiny_model_dir)


def chat(*replies_and_weights, system="Answer briefly."):
    """system, then a user question and an assistant reply (with its weight, None: no weight key) per pair."""
    messages = [{"role": "system", "content": system}]
    for n, (reply, weight) in enumerate(replies_and_weights):
        messages.append({"role": "user", "content": f"question number {n}?"})
        messages.append({"role": "assistant", "content": reply, **({} if weight is None else {"weight": weight})})
    return messages


def tool_chat(arguments):
    return [{"role": "system", "content": "Use the tools."},
            {"role": "user", "content": "What is 17 plus 25?"},
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": arguments}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": "42"},
            {"role": "assistant", "content": "The sum is 42."}]


def runs(tokenizer, sample, value=1):
    """The decoded text of each maximal run of tokens whose mask is `value`."""
    out, current = [], []
    for token, m in zip(sample.token_ids, sample.loss_mask, strict=True):
        if m == value:
            current.append(token)
        elif current:
            out.append(current)
            current = []
    out += [current] if current else []
    return [tokenizer.decode(r, skip_special_tokens=False, clean_up_tokenization_spaces=False) for r in out]


def only(data):
    assert len(data.samples) == 1, (data.samples, data.skipped)
    return data.samples[0]


def test_mask_is_exactly_the_learned_replies(tokenizer):
    messages = chat(("A few-shot reply the agent wrote.", 0), ("Paris, on the Seine.", 1), ("For history.", None))
    # Content as text parts, on a user turn and on a learned turn.
    messages[3]["content"] = [{"type": "text", "text": "Capital "}, {"type": "text", "text": "of France?"}]
    messages[4]["content"] = [{"type": "text", "text": "Paris, "}, {"type": "text", "text": "on the Seine."}]
    data = chat_samples([{"messages": messages, "tools": None}], tokenizer, max_length=4096)
    sample = only(data)
    assert (data.records, data.skipped, data.split_per_turn) == (1, {}, 0)
    eos = tokenizer.eos_token
    assert runs(tokenizer, sample) == ["Paris, on the Seine." + eos, "For history." + eos]
    # The ids are the template's text, whole; the context is everything else in it.
    texts = [m["content"] if isinstance(m["content"], str) else "".join(p["text"] for p in m["content"])
             for m in messages]
    plain = [{"role": m["role"], "content": text} for m, text in zip(messages, texts, strict=True)]
    assert tokenizer.decode(sample.token_ids, skip_special_tokens=False) == tokenizer.apply_chat_template(
        plain, tokenize=False)
    context = "".join(runs(tokenizer, sample, 0))
    for m, text in zip(messages, texts, strict=True):
        if m["role"] != "assistant" or m.get("weight") == 0:
            assert text in context
    assert "A few-shot reply" not in "".join(runs(tokenizer, sample))
    assert sample.loss_mask[0] == 0 and set(sample.loss_mask) == {0, 1}
    assert sample.logprobs == [0.0] * len(sample.token_ids) and len(sample.loss_mask) == len(sample.token_ids)
    assert (sample.episode_id, sample.role_key, sample.call_ids, sample.choice_indices) == ("record-0", "chat", [], [])


def test_tool_call_turns_are_learned_and_tool_results_are_not(tokenizer):
    # JSON text spaced unlike the template's tojson: were it passed as text, the template would print it as is.
    arguments_text = json.dumps(ARGUMENTS, separators=(",", ":"))
    data = chat_samples([{"messages": tool_chat(arguments_text), "tools": TOOLS}], tokenizer, max_length=4096)
    sample = only(data)
    call, answer = runs(tokenizer, sample)
    eos = tokenizer.eos_token
    assert call.startswith("<tool_call>") and call.endswith("</tool_call>" + eos)
    assert json.loads(call.removeprefix("<tool_call>").removesuffix("</tool_call>" + eos)) == {
        "name": "add", "arguments": ARGUMENTS}
    assert answer == "The sum is 42." + eos
    context = "".join(runs(tokenizer, sample, 0))
    assert "<tool_response>\n42\n</tool_response>" in context and "What is 17 plus 25?" in context
    # The template gets the arguments as an object, whichever way the record holds them.
    as_object = chat_samples([{"messages": tool_chat(ARGUMENTS), "tools": TOOLS}], tokenizer, max_length=4096)
    assert only(as_object) == sample


def test_tools_as_json_text_equal_tools_as_a_list(tokenizer):
    record = {"messages": tool_chat(json.dumps(ARGUMENTS))}
    as_list = only(chat_samples([{**record, "tools": TOOLS}], tokenizer, max_length=4096))
    as_text = only(chat_samples([{**record, "tools": json.dumps(TOOLS)}], tokenizer, max_length=4096))
    without = only(chat_samples([{**record, "tools": None}], tokenizer, max_length=4096))
    assert as_text == as_list
    assert TOOLS[0]["function"]["description"] in tokenizer.decode(as_list.token_ids)
    assert without.token_ids != as_list.token_ids  # the tools are rendered, not dropped


def test_prompt_completion_equals_messages_with_weights(tokenizer):
    messages = chat(("An example answer.", None), ("The answer to learn.", None))
    pc = chat_samples([{"prompt": messages[:4], "completion": messages[4:], "tools": TOOLS}], tokenizer,
                      max_length=4096)
    weighted = [{**m, "weight": int(i == 4)} if m["role"] == "assistant" else m for i, m in enumerate(messages)]
    mw = chat_samples([{"messages": weighted, "tools": TOOLS}], tokenizer, max_length=4096)
    assert only(pc) == only(mw)
    assert runs(tokenizer, only(pc)) == ["The answer to learn." + tokenizer.eos_token]
    # A prompt's assistant turn that says weight 1 is learned.
    messages[2]["weight"] = 1
    pc = chat_samples([{"prompt": messages[:4], "completion": messages[4:]}], tokenizer, max_length=4096)
    assert len(runs(tokenizer, only(pc))) == 2


def test_a_template_that_rerenders_earlier_turns_gives_one_sample_per_turn(tiny_model_dir, tokenizer):
    rerenders = AutoTokenizer.from_pretrained(tiny_model_dir)
    rerenders.chat_template = DROPS_EARLIER_TURNS
    rows = [{"messages": chat(("First reply.", 1), ("Second reply.", 1))},
            {"messages": chat(("Context reply.", 0), ("Last reply.", 1))},  # the last turn only: nothing dropped
            {"messages": chat(("Learned reply.", 1), ("Context at the end.", 0))}]
    data = chat_samples(rows, rerenders, max_length=4096)
    assert data.split_per_turn == 2 and data.records == 3 and data.skipped == {}
    eos = rerenders.eos_token
    assert [(s.episode_id, runs(rerenders, s)) for s in data.samples] == [
        ("record-0", ["First reply." + eos]), ("record-0", ["Second reply." + eos]),
        ("record-1", ["Last reply." + eos]), ("record-2", ["Learned reply." + eos])]
    # Each turn's sample is the conversation up to it, as the model saw it then.
    first = rows[0]["messages"][:3]
    assert rerenders.decode(data.samples[0].token_ids) == rerenders.apply_chat_template(first, tokenize=False)
    assert "(an earlier reply)" in rerenders.decode(data.samples[1].token_ids)
    # The tiny model's own template only appends: the same records give one sample each.
    appends = chat_samples(rows, tokenizer, max_length=4096)
    assert appends.split_per_turn == 0 and [s.episode_id for s in appends.samples] == ["record-0", "record-1",
                                                                                       "record-2"]


def test_a_turn_at_the_start_of_the_text_never_masks_the_first_token(tiny_model_dir):
    replies_only = AutoTokenizer.from_pretrained(tiny_model_dir)
    replies_only.chat_template = ("{% for m in messages %}{% if m.role == 'assistant' %}{{ m.content }}<|im_end|>"
                                  "{% endif %}{% endfor %}")
    messages = [{"role": "user", "content": "not rendered"}, {"role": "assistant", "content": "The whole text."}]
    sample = only(chat_samples([{"messages": messages}], replies_only, max_length=4096))
    assert replies_only.decode(sample.token_ids) == "The whole text.<|im_end|>"
    assert sample.loss_mask[0] == 0 and all(sample.loss_mask[1:]) and len(sample.token_ids) > 2


def test_templates_that_cannot_delimit_a_turn(tiny_model_dir):
    thinks = AutoTokenizer.from_pretrained(tiny_model_dir)  # its generation prompt opens a block its turns lack
    thinks.chat_template = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
                            "{% if add_generation_prompt %}<|im_start|>assistant\n<think>\n{% endif %}")
    data = chat_samples([{"messages": chat(("Reply.", 1))}], thinks, max_length=4096)
    assert data.samples == [] and data.skipped == {"turn_does_not_extend_prompt": 1}
    thinks.chat_template = "{{ raise_exception('Conversation roles must alternate') }}"
    with pytest.raises(ChatDataError, match=r"record 0: the chat template can't render .*roles must alternate"):
        chat_samples([{"messages": chat(("Reply.", 1))}], thinks, max_length=4096)


def test_too_long_and_nothing_to_learn_are_left_out_and_counted(tokenizer):
    record = {"messages": chat(("Short.", 1), ("Also short.", None))}
    n = len(only(chat_samples([record], tokenizer, max_length=4096)).token_ids)
    assert len(only(chat_samples([record], tokenizer, max_length=n)).token_ids) == n
    rows = [record, {"messages": chat(("Context.", 0))}, {"messages": [{"role": "user", "content": "hi"}]}]
    data = chat_samples(rows, tokenizer, max_length=n - 1)
    assert data.samples == [] and data.records == 3
    assert data.skipped == {"too_long": 1, "no_assistant_turn_to_learn": 2}


@pytest.mark.parametrize(("record", "named"), [
    ({"text": "hi"}, "text"),
    ({"prompt": "2+2?", "completion": "4"}, "prompt"),
    ({"messages": "hi there"}, "messages"),
    ({"prompt": [{"role": "user", "content": "hi"}]}, "prompt"),
])
def test_bad_records_name_their_index_and_keys(tokenizer, record, named):
    good = {"messages": chat(("Fine.", 1))}
    with pytest.raises(ChatDataError, match=rf"record 1 has keys .*{named}.*accepted shapes") as caught:
        chat_samples([good, record], tokenizer, max_length=4096)
    assert '"messages"' in str(caught.value) and '"completion"' in str(caught.value)


def test_bad_messages_and_weights_name_the_value(tokenizer):
    messages = chat(("Half.", 0.5))
    with pytest.raises(ChatDataError, match=r"record 0, messages\[2\]: weight 0.5; give 1 .* or 0"):
        chat_samples([{"messages": messages}], tokenizer, max_length=4096)
    with pytest.raises(ChatDataError, match=r"record 0, messages\[0\] is 'hi'"):
        chat_samples([{"messages": ["hi"]}], tokenizer, max_length=4096)
    with pytest.raises(ChatDataError, match=r"record 0: tools .* is text but not JSON"):
        chat_samples([{"messages": chat(("x", 1)), "tools": "[not json"}], tokenizer, max_length=4096)


def test_read_chat_records_reads_jsonl_json_parquet_and_saved_datasets_alike(tmp_path, tokenizer):
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    # As `harness export` writes them: tools as JSON text (columnar formats need one type a column).
    rows = [{"messages": tool_chat(json.dumps(ARGUMENTS)), "tools": json.dumps(TOOLS), "episode_id": "e1"},
            {"messages": chat(("Context.", 0), ("Learned.", 1)), "tools": None, "episode_id": "e2"}]
    (tmp_path / "chat.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows) + "\n")
    (tmp_path / "chat.json").write_text(json.dumps(rows))
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "chat.parquet")
    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "one"))
    datasets.DatasetDict({"train": datasets.Dataset.from_list(rows[:1]),
                          "test": datasets.Dataset.from_list(rows)}).save_to_disk(str(tmp_path / "splits"))
    expected = chat_samples(rows, tokenizer, max_length=4096)
    assert len(expected.samples) == 2
    for source, split in [("chat.jsonl", "train"), ("chat.json", "train"), ("chat.parquet", "train"),
                          ("one", "train"), ("splits", "test")]:
        read = read_chat_records(tmp_path / source, split=split)
        assert read == rows, source
        assert chat_samples(read, tokenizer, max_length=4096) == expected, source
        assert read_chat_records(str(tmp_path / source), split=split, limit=1) == rows[:1], source
    assert read_chat_records(tmp_path / "splits") == rows[:1]
    with pytest.raises(ChatDataError, match=r"no split 'validation' \(its splits: train, test\)"):
        read_chat_records(tmp_path / "splits", split="validation")


def test_read_chat_records_errors_name_the_file_and_line(tmp_path):
    good = json.dumps({"messages": chat(("Fine.", 1))})
    (tmp_path / "bad.jsonl").write_text(f"{good}\n\n{good[:-5]}\n{good}\n")
    with pytest.raises(ChatDataError, match=r"bad.jsonl line 3 is not JSON"):
        read_chat_records(tmp_path / "bad.jsonl")
    assert len(read_chat_records(tmp_path / "bad.jsonl", limit=1)) == 1  # the bad line is never reached
    (tmp_path / "list.jsonl").write_text(f"{good}\n[1, 2]\n")
    with pytest.raises(ChatDataError, match=r"list.jsonl line 2 holds list; each line must be one JSON object"):
        read_chat_records(tmp_path / "list.jsonl")
    with pytest.raises(ChatDataError, match=r"missing.jsonl' does not exist"):
        read_chat_records(tmp_path / "missing.jsonl")
    (tmp_path / "chat.csv").write_text("messages\n")
    with pytest.raises(ChatDataError, match=r"files ending in '.csv' are not read"):
        read_chat_records(tmp_path / "chat.csv")
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(ChatDataError, match=r"empty.jsonl holds no records"):
        read_chat_records(tmp_path / "empty.jsonl")
    (tmp_path / "object.json").write_text(good)
    with pytest.raises(ChatDataError, match=r"object.json holds dict; a .json file holds one list of objects"):
        read_chat_records(tmp_path / "object.json")
    (tmp_path / "plain").mkdir()
    with pytest.raises(ChatDataError, match=r"plain is a directory but not one saved with datasets' save_to_disk"):
        read_chat_records(tmp_path / "plain")
    with pytest.raises(ChatDataError, match=r"limit 0: give a positive number"):
        read_chat_records(tmp_path / "bad.jsonl", limit=0)
