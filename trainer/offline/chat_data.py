"""Chat records (supervised fine-tuning data) as token-level training samples with an exact loss mask, for
`harness sft`.

    read_chat_records   rows of a .jsonl / .json / .parquet file or a `datasets` save_to_disk directory
    chat_samples        rows -> Samples: the model's chat template rendered as text, tokenised once, and a mask of
                        1 on exactly the tokens of the assistant turns to learn

Accepted record shapes: `{"messages": [...], "tools": ...}` (what `harness export --records chat` writes, and TRL /
OpenAI fine-tuning files; an assistant message's `weight` 0 makes it context only) and TRL's conversational
`{"prompt": [...], "completion": [...]}` (the prompt's assistant turns are context, the completion's are learned).

Where a turn is in the text: the template's render of the messages before it with the generation prompt is where
it starts; it ends just after its end-of-turn token (the tokenizer's eos text), which the engine samples, so it is
learned, and the newline the template writes after it is not. This needs a template that only appends: rendering
the first k messages gives a prefix of rendering them all. Templates that re-render earlier turns (Qwen3 drops the
reasoning of turns before the last user message) break that; such a record is trained as one sample per learned
turn, each the conversation up to that turn as the model saw it then. Nothing is truncated: a sample longer than
max_length is left out and counted. Record numbers count from 0.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from harness import install_hint
from harness.core.records import Sample
from harness.store.export import parsed_arguments

__all__ = ["ChatData", "ChatDataError", "chat_samples", "read_chat_records"]

_SHAPES = ('{"messages": [chat messages], "tools": [...] | JSON text | null} (harness export --records chat, TRL, '
           'OpenAI fine-tuning files) or {"prompt": [chat messages], "completion": [chat messages]} (TRL)')
_MESSAGE_LISTS = ("messages", "prompt", "completion")


class ChatDataError(ValueError):
    """Bad chat data; the message names the value and what to do."""


@dataclass
class ChatData:
    samples: list[Sample]
    skipped: dict[str, int] = field(default_factory=dict)  # reason -> records (split records: turns) left out
    split_per_turn: int = 0  # records whose template re-renders earlier turns, trained as one sample per turn
    records: int = 0  # records read


# ------------------------------------------------------------------------------------------------ reading


def read_chat_records(source: str | Path, *, split: str = "train", limit: int | None = None) -> list[dict]:
    """Rows of a .jsonl file, a .json file (a list of objects), a .parquet file, or a directory written by
    datasets' Dataset.save_to_disk / DatasetDict.save_to_disk (`split` picks the DatasetDict's split); at most
    `limit` of them."""
    path = Path(source)
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 1):
        raise ChatDataError(f"limit {limit!r}: give a positive number of records, or None for all")
    if not path.exists():
        raise ChatDataError(f"{str(path)!r} does not exist: give a .jsonl, .json or .parquet file, or a directory "
                            "saved with datasets' save_to_disk")
    if path.is_dir():
        rows = _read_saved_dataset(path, split, limit)
    elif path.suffix == ".jsonl":
        rows = _read_jsonl(path, limit)
    elif path.suffix == ".json":
        try:
            rows = json.loads(path.read_text(encoding="utf-8"))
        except ValueError as exc:
            raise ChatDataError(f"{path} is not JSON ({exc}); a .json file holds one list of records") from None
        if not isinstance(rows, list) or not all(isinstance(r, dict) for r in rows):
            raise ChatDataError(f"{path} holds {type(rows).__name__}; a .json file holds one list of objects (one "
                                "per record); for one object a line, name it .jsonl")
        rows = rows[:limit]
    elif path.suffix == ".parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        try:
            table = pq.read_table(path)
        except (pa.ArrowException, OSError) as exc:
            raise ChatDataError(f"{path} can't be read as Parquet ({exc})") from None
        rows = [_without_filled_nulls(r) for r in table.slice(0, limit).to_pylist()]
    else:
        raise ChatDataError(f"can't read chat records from {path}: files ending in {path.suffix or '(no suffix)'!r} "
                            "are not read; give a .jsonl, .json or .parquet file, or a datasets save_to_disk directory")
    if not rows:
        raise ChatDataError(f"{path} holds no records" + (f" in split {split!r}" if path.is_dir() else ""))
    return rows


def _read_jsonl(path: Path, limit: int | None) -> list[dict]:
    rows = []
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, start=1):
            if limit is not None and len(rows) >= limit:
                break
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except ValueError as exc:
                raise ChatDataError(f"{path} line {number} is not JSON ({exc}); fix or remove that line") from None
            if not isinstance(row, dict):
                raise ChatDataError(f"{path} line {number} holds {type(row).__name__}; each line must be one JSON "
                                    "object (one record)")
            rows.append(row)
    return rows


def _read_saved_dataset(path: Path, split: str, limit: int | None) -> list[dict]:
    if not ((path / "dataset_dict.json").is_file() or (path / "state.json").is_file()):
        raise ChatDataError(f"{path} is a directory but not one saved with datasets' save_to_disk (no "
                            "dataset_dict.json or state.json in it); give that directory, or a data file")
    try:
        import datasets
    except ImportError:
        raise ChatDataError(f"reading {path} needs the 'datasets' package: {install_hint('data')}") from None
    loaded = datasets.load_from_disk(str(path))
    if isinstance(loaded, datasets.DatasetDict):
        if split not in loaded:
            raise ChatDataError(f"{path} has no split {split!r} (its splits: {', '.join(loaded) or 'none'}); "
                                "pass one of those as split")
        loaded = loaded[split]  # a lone Dataset has no splits: it is read whatever `split` says
    if limit is not None:
        loaded = loaded.select(range(min(limit, len(loaded))))
    return [_without_filled_nulls(r) for r in loaded.to_list()]


def _without_filled_nulls(row: dict) -> dict:
    """A columnar row with the nulls its schema filled in taken out of its messages (a user message gets
    `tool_calls: None` because an assistant message has them), so a row reads the same from every format."""
    for key in _MESSAGE_LISTS:
        if isinstance(row.get(key), list):
            row[key] = [{k: v for k, v in m.items() if v is not None or k == "content"} if isinstance(m, dict)
                        else m for m in row[key]]
    return row


# ------------------------------------------------------------------------------------------------ samples


def chat_samples(rows: Iterable[dict], tokenizer, *, max_length: int) -> ChatData:
    """Samples of chat records: the template's text tokenised once, loss mask 1 on the learned assistant turns
    (their end-of-turn token included), logprobs 0.0 (no engine sampled them)."""
    if not getattr(tokenizer, "is_fast", False):
        raise ChatDataError(f"{type(tokenizer).__name__} is not a fast tokenizer: the loss mask needs its character "
                            "offsets; load the model's tokenizer.json with AutoTokenizer.from_pretrained(path)")
    if not tokenizer.chat_template:
        raise ChatDataError(f"tokenizer {tokenizer.name_or_path!r} has no chat template: give the model's own "
                            "tokenizer, or set tokenizer.chat_template")
    if isinstance(max_length, bool) or not isinstance(max_length, int) or max_length < 2:
        raise ChatDataError(f"max_length {max_length!r}: give the longest sample to keep, in tokens (2 or more)")
    out = ChatData(samples=[])

    def skip(reason: str) -> None:
        out.skipped[reason] = out.skipped.get(reason, 0) + 1

    def add(index: int, text: str, spans: list[tuple[int, int]]) -> None:
        sample = _sample(f"record-{index}", text, spans, tokenizer)
        if len(sample.token_ids) > max_length:
            skip("too_long")
        elif not any(sample.loss_mask):
            skip("empty_turn")  # the learned turns render to no token after the first
        else:
            out.samples.append(sample)

    for index, row in enumerate(rows):
        out.records += 1
        messages, learn, tools = _record(row, index)
        if not learn:
            skip("no_assistant_turn_to_learn")
            continue

        where = f"record {index}"
        full = _render(tokenizer, messages, tools, False, where)
        turns = []  # (the text up to the turn, the turn's span in it, whether `full` starts with that text)
        for i in learn:
            prompt = _render(tokenizer, messages[:i], tools, True, where)
            upto = _render(tokenizer, messages[:i + 1], tools, False, where)
            if not upto.startswith(prompt):
                break  # the generation prompt is not how the template starts the turn: no exact span
            span = (len(prompt), _turn_end(upto, len(prompt), tokenizer.eos_token))
            turns.append((upto, span, full.startswith(prompt) and full.startswith(upto)))
        if len(turns) < len(learn):
            skip("turn_does_not_extend_prompt")
        elif all(appends for _, _, appends in turns):
            add(index, full, [span for _, span, _ in turns])
        else:
            out.split_per_turn += 1
            for upto, span, _ in turns:
                add(index, upto, [span])
    return out


def _render(tokenizer, messages: list[dict], tools: list | None, prompt: bool, where: str) -> str:
    try:
        return tokenizer.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=prompt)
    except Exception as exc:  # jinja's TemplateError, or what the template's own raise_exception says
        raise ChatDataError(f"{where}: the chat template can't render its first {len(messages)} messages "
                            f"({type(exc).__name__}: {exc}); fix or leave out the record") from None


def _turn_end(text: str, start: int, eos: str | None) -> int:
    """Just after the turn's last end-of-turn token (what the engine stops on); the text's end if it has none."""
    at = text.rfind(eos, start) if eos else -1
    return at + len(eos) if at >= 0 else len(text)


def _sample(episode_id: str, text: str, spans: list[tuple[int, int]], tokenizer) -> Sample:
    encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    ids = list(encoded["input_ids"])
    # A token is learned where it starts inside a span; a token that straddles a span's start (the template's
    # last prompt characters merged with the reply's first) stays context.
    mask = [int(any(a <= start < b for a, b in spans)) for start, _ in encoded["offset_mapping"]]
    if mask:
        mask[0] = 0  # a first token has nothing to be predicted from (and Sample consumers refuse it)
    return Sample(episode_id=episode_id, role_key="chat", call_ids=[], choice_indices=[], token_ids=ids,
                  loss_mask=mask, logprobs=[0.0] * len(ids))


def _record(row: Any, index: int) -> tuple[list[dict], list[int], list | None]:
    """A record's messages as the template gets them, the indices of the assistant turns to learn, its tools."""
    if not isinstance(row, dict):
        raise ChatDataError(f"record {index} is {type(row).__name__}, not an object; accepted shapes: {_SHAPES}")
    if "messages" in row:
        parts = [("messages", row["messages"], 1)]
    elif "prompt" in row and "completion" in row:
        parts = [("prompt", row["prompt"], 0), ("completion", row["completion"], 1)]
    else:
        parts = []
    if not parts or not all(isinstance(value, list) for _, value, _ in parts):
        has = ", ".join(f"{k} ({type(row[k]).__name__})" for k in row) or "none"
        raise ChatDataError(f"record {index} has keys {has}; accepted shapes, with lists of messages: {_SHAPES}")
    messages, learn = [], []
    for key, value, default in parts:
        for n, m in enumerate(value):
            where = f"record {index}, {key}[{n}]"
            if not isinstance(m, dict) or not isinstance(m.get("role"), str):
                raise ChatDataError(f"{where} is {m!r:.80}; a message is an object with a \"role\" string")
            weight = m.get("weight")
            if m["role"] == "assistant":
                weight = default if weight is None else weight
                if weight not in (0, 1):
                    raise ChatDataError(f"{where}: weight {m['weight']!r}; give 1 (learn this turn) or 0 (context)")
                if weight and messages:  # an opening assistant message has no prompt to answer: context
                    learn.append(len(messages))
            messages.append(_message(m, where))
    return messages, learn, _tools(row.get("tools"), index)


def _message(m: dict, where: str) -> dict:
    """The message as a chat template reads it: no `weight`, no null keys, text parts joined, tool call arguments
    as objects (JSON text parsed, as vLLM does before rendering)."""
    out = {k: v for k, v in m.items() if k != "weight" and v is not None}
    content = m.get("content")
    if isinstance(content, list):
        content = "".join(p.get("text") or "" for p in content if isinstance(p, dict))
    out["content"] = content
    if "tool_calls" in out:
        calls = out["tool_calls"]
        if not isinstance(calls, list) or not all(isinstance(c, dict) for c in calls):
            raise ChatDataError(f"{where}: tool_calls {calls!r:.80} is not a list of objects (OpenAI shape)")
        out["tool_calls"] = [
            {**c, "function": {**c["function"], "arguments": parsed_arguments(c["function"].get("arguments"))}}
            if isinstance(c.get("function"), dict) else c for c in calls]
    return out


def _tools(tools: Any, index: int) -> list | None:
    if isinstance(tools, str):  # parquet and hf exports store the tool list as JSON text
        try:
            tools = json.loads(tools)
        except ValueError:
            raise ChatDataError(f"record {index}: tools {tools!r:.80} is text but not JSON; give a list of tools "
                                "(OpenAI shape), its JSON text, or null") from None
    if tools is not None and not isinstance(tools, list):
        raise ChatDataError(f"record {index}: tools is {type(tools).__name__}; give a list of tools (OpenAI shape), "
                            "its JSON text, or null")
    return tools or None
