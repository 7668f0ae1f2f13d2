"""`harness retokenize --model DIR`: token ids for calls recorded as text only (in front of a hosted API, or an
engine that returned none), marked so they are never taken for the engine's own.

A chat call's prompt ids are the model's chat template applied to the request's messages (and tools) with the
generation prompt; each choice's completion ids are the assistant turn as the template renders it after that
prompt, up to and including its end-of-turn token. A completions call's prompt and text are tokenized as they
are. The call's `token_source` becomes `retokenized` and `extra.retokenized` names the tokenizer; the choices'
`logprobs` become NULL (no engine sampled these tokens): logprobs the upstream returned over its own tokens move to
`extra.retokenized.upstream_logprobs`, by choice index. The merger builds samples from engine ids only
(harness/core/merge.py), so retokenized calls stay out of RL training.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from harness.core.records import NONE, OK, RETOKENIZED
from harness.store.export import parsed_arguments

__all__ = ["RETOKENIZED", "Retokenized", "retokenize_database"]

_PENDING = """
SELECT c.call_id, c.endpoint, c.request, list(ch.text ORDER BY ch.choice_index), list(ch.tool_calls ORDER BY
       ch.choice_index), list(ch.choice_index ORDER BY ch.choice_index), list(ch.logprobs ORDER BY ch.choice_index)
FROM calls c JOIN choices ch USING (call_id)
WHERE c.token_source = ? AND c.status = ? {run} GROUP BY ALL ORDER BY c.call_id
"""


@dataclass
class Retokenized:
    calls: int  # calls given ids
    choices: int
    skipped: dict[str, int]  # calls left as they were, by reason


def retokenize_database(db_path: str | Path, model_dir: str | Path, run_id: str | None = None) -> Retokenized:
    """Give every text-only call of `run_id` (every run when None) ids from `model_dir`'s tokenizer."""
    from transformers import AutoTokenizer

    from harness.store.database import Store

    with Store.open(db_path) as store:  # first: a file that is no harness database is refused before any tokenizer
        tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
        if tokenizer.chat_template is None:
            raise ValueError(f"{str(model_dir)!r} has no chat template: give the model the agent's calls were meant "
                             "for")
        rows = store.query(_PENDING.format(run="AND c.run_id = ?" if run_id else ""),
                           [NONE, OK, *([run_id] if run_id else [])]).rows
        calls, choices, skipped = [], [], {}
        tokenizer_path = str(Path(model_dir).resolve())
        for call_id, endpoint, request, texts, tool_calls, indices, logprobs in rows:
            try:
                prompt, completions = _ids(tokenizer, endpoint, json.loads(request), texts, tool_calls)
            except (ValueError, TypeError, KeyError) as exc:  # a request the template cannot render
                reason = type(exc).__name__
                skipped[reason] = skipped.get(reason, 0) + 1
                continue
            note: dict[str, Any] = {"tokenizer": tokenizer_path}
            if any(lp is not None for lp in logprobs):  # the upstream's, over its own tokens: kept here
                note["upstream_logprobs"] = {str(i): lp for i, lp in zip(indices, logprobs, strict=True)}
            calls.append((call_id, prompt, json.dumps(note)))
            choices += [(call_id, i, ids) for i, ids in zip(indices, completions, strict=True)]
        if not calls:
            return Retokenized(0, 0, skipped)
        with store.cursor() as cur:
            cur.begin()
            cur.executemany("UPDATE calls SET prompt_ids = ?, token_source = ?, extra = json_merge_patch("
                            "coalesce(extra, '{}'), json_object('retokenized', json(?))) WHERE call_id = ?",
                            [(prompt, RETOKENIZED, note, call_id) for call_id, prompt, note in calls])
            cur.executemany("UPDATE choices SET completion_ids = ?, logprobs = NULL WHERE call_id = ? AND "
                            "choice_index = ?", [(ids, call_id, i) for call_id, i, ids in choices])
            cur.commit()
    return Retokenized(len(calls), len(choices), skipped)


def _ids(tokenizer, endpoint: str, request: dict[str, Any], texts: list, tool_calls: list) -> tuple[list, list]:
    if endpoint != "chat":
        prompt = request.get("prompt")
        if not isinstance(prompt, str):
            raise TypeError("a completions prompt that is not one string")
        return (tokenizer.encode(prompt, add_special_tokens=False),
                [tokenizer.encode(t or "", add_special_tokens=False) for t in texts])
    messages, tools = request["messages"], request.get("tools")
    prompt_text = tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=False)
    completions = []
    for text, calls in zip(texts, tool_calls, strict=True):
        answer = {"role": "assistant", "content": text or ""}
        if calls:
            answer["tool_calls"] = [
                {**c, "function": {**c["function"], "arguments": parsed_arguments(c["function"].get("arguments"))}}
                for c in (json.loads(calls) if isinstance(calls, str) else calls)]
        whole = tokenizer.apply_chat_template(messages + [answer], tools=tools, tokenize=False)
        if not whole.startswith(prompt_text):
            raise ValueError("the template renders the answer's history differently from the prompt")
        turn = whole[len(prompt_text):]
        end = tokenizer.eos_token or ""
        if end and end in turn:
            turn = turn[:turn.index(end) + len(end)]  # the turn ends at its end token: what the engine stops on
        completions.append(tokenizer.encode(turn, add_special_tokens=False))
    return tokenizer.encode(prompt_text, add_special_tokens=False), completions
