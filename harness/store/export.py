"""Recorded episodes as training data: chat records for supervised fine-tuning, token records for RL
(`harness export --run`, docs/export.md).

    chat    one record per conversation an episode's calls form: the messages of the last call on it plus its
            answer, each assistant message with `weight` 1 if it is a reply the model gave in this episode
            (recorded), 0 if the agent wrote it (a few-shot example, an edited history). The shape TRL's SFT
            trainer (`messages`, `tools`) and OpenAI-style fine-tuning files read; works on text-only calls.
    tokens  one record per merged sample (docs/schema.md: samples): the engine's token ids, the loss mask, the
            engine's logprobs, the episode's reward and its GRPO advantage against its task's group.

Episodes are chosen by run and, optionally, a SQL predicate over the columns of `EPISODE_COLUMNS` (`reward >= 1`,
`status = 'finished' AND n_errors = 0`), checked read-only like `harness sql`. Reads go through sql.Reader,
so a database a proxy is recording into can be exported while it runs.
"""

from __future__ import annotations

import json
import shutil
import statistics
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson

from harness import install_hint
from harness.store.sql import Reader, SqlError

__all__ = ["EPISODE_COLUMNS", "ExportError", "FORMATS", "RECORDS", "episodes", "records", "write"]

RECORDS = ("chat", "tokens")
FORMATS = ("jsonl", "parquet", "hf")
# What --where may name: one row per episode of the run.
EPISODE_COLUMNS = {
    "episode_id": "the episode",
    "task_id": "the task (NULL for episodes recorded without a dataset run)",
    "repeat_index": "the episode's index in its task's group",
    "status": "how the agent's run ended (episode_outcomes.status; NULL without a dataset run)",
    "reward": "the episode's latest judgement, whichever judge (NULL if not judged, or that judge failed)",
    "n_calls": "calls recorded", "n_errors": "calls that failed",
    "outcome_run": "the run of its outcome: a harness run's id, or a training step's (<run>-train00012)",
    "recorded_in": "the run that recorded it (a proxy's; in a training run, the whole training run's)",
}
_EPISODES = """
WITH latest AS (SELECT episode_id, reward FROM judgements
                QUALIFY row_number() OVER (PARTITION BY episode_id ORDER BY created_at DESC) = 1),
episode AS (SELECT s.episode_id, o.task_id, o.repeat_index, o.status, latest.reward, s.n_calls, s.n_errors,
                   s.run_id AS recorded_in, o.run_id AS outcome_run
            FROM episode_summary s LEFT JOIN episode_outcomes o USING (episode_id) LEFT JOIN latest USING (episode_id)
            WHERE (s.run_id = ? AND NOT regexp_matches(coalesce(o.run_id, ''), '-(val|greedy)[0-9]+$')) OR o.run_id = ?)
SELECT * FROM episode WHERE ({where}) ORDER BY task_id NULLS LAST, repeat_index, episode_id
"""
_CALLS = """
SELECT c.episode_id, c.call_id, c.request, ch.choice_index, ch.text, ch.tool_calls, ch.reasoning
FROM calls c JOIN choices ch USING (call_id)
WHERE c.episode_id IN (SELECT unnest(?)) AND c.status = 'ok' AND c.endpoint = 'chat'
ORDER BY c.episode_id, c.call_index, ch.choice_index
"""
_SAMPLES = """
SELECT sample_id, run_id, episode_id, role_key, token_ids, loss_mask, logprobs, n_trainable,
       coalesce(truncation, []) AS truncation
FROM samples WHERE run_id IN (SELECT unnest(?)) AND episode_id IN (SELECT unnest(?))
ORDER BY episode_id, sample_index
"""
_BATCH = 256  # episodes read per query


class ExportError(ValueError):
    """Bad input to an export; the message names the value and what to do."""


def episodes(reader: Reader, run_id: str, where: str | None = None) -> list[dict[str, Any]]:
    """The run's episodes (EPISODE_COLUMNS) that `where` keeps, in task and repeat order. `run_id`: the run that
    recorded them (a proxy's, a harness run's, a whole harness train's: its training episodes, not its validation
    or ReMax greedy ones, which sampled otherwise) or the run of their outcomes (one step: `<run>-train00012`, or
    `<run>-val00010` asked for by name)."""
    if not reader.query("SELECT 1 FROM episode_summary WHERE run_id = ? UNION ALL SELECT 1 FROM episode_outcomes "
                        "WHERE run_id = ? LIMIT 1", [run_id, run_id]).rows:
        known = [r for r, in reader.query("SELECT DISTINCT run_id FROM episode_summary ORDER BY 1").rows]
        raise ExportError(f"run {run_id!r} has no episodes in {str(reader.db_path)!r}; runs there: "
                          f"{', '.join(known[-10:]) or 'none'}")
    try:
        result = reader.query(_EPISODES.format(where=where or "true"), [run_id, run_id])
    except SqlError as exc:
        raise ExportError(f"--where {where!r}: {exc}; it may name {', '.join(EPISODE_COLUMNS)}") from None
    return [dict(zip(result.columns, row, strict=True)) for row in result.rows]


def records(reader: Reader, run_id: str, kind: str = "chat", where: str | None = None) -> Iterator[dict[str, Any]]:
    """The export's records, episode by episode (`kind`: chat or tokens)."""
    if kind not in RECORDS:
        raise ExportError(f"records {kind!r}: choose one of {', '.join(RECORDS)}")
    chosen = episodes(reader, run_id, where)
    if kind == "tokens":  # against the whole group, whatever the filter keeps
        advantages = _advantages(episodes(reader, run_id) if where else chosen)
    for start in range(0, len(chosen), _BATCH):
        batch = chosen[start:start + _BATCH]
        ids = [e["episode_id"] for e in batch]
        if kind == "chat":
            rows = reader.query(_CALLS, [ids])
            by_episode: dict[str, list[dict]] = {}
            for row in rows.rows:
                call = dict(zip(rows.columns, row, strict=True))
                by_episode.setdefault(call["episode_id"], []).append(call)
            for episode in batch:
                for conversation in conversations(by_episode.get(episode["episode_id"], [])):
                    yield {**conversation, **_about(episode, run_id)}
        else:
            # merged under the run asked for (harness merge --run), else under the run that recorded the episode
            rows = reader.query(_SAMPLES, [sorted({run_id, *(e["recorded_in"] for e in batch)}), ids])
            about = {e["episode_id"]: e for e in batch}
            samples = [dict(zip(rows.columns, row, strict=True)) for row in rows.rows]
            merged_in = {}
            for sample in samples:
                if merged_in.get(sample["episode_id"]) != run_id:
                    merged_in[sample["episode_id"]] = sample["run_id"]
            for sample in samples:
                if sample.pop("run_id") != merged_in[sample["episode_id"]]:
                    continue
                episode = about[sample["episode_id"]]
                yield {**sample, "loss_mask": list(sample["loss_mask"]), **_about(episode, run_id),
                       "advantage": advantages.get(sample["episode_id"])}


def conversations(calls: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """An episode's calls (and their choices, in call order) as the conversations they form: a call's messages
    plus one of its answers, left out where a later call's messages continue it (that call's record holds it)."""
    generated: set[bytes] = set()
    ends: list[tuple[list[dict], list[bytes], dict]] = []
    for call in calls:
        request = _json(call["request"])
        history = [_message(m) for m in request.get("messages") or []]
        answer = _message({"role": "assistant", "content": call["text"], "tool_calls": _json(call["tool_calls"])})
        if call["reasoning"]:
            answer["reasoning"] = call["reasoning"]
        generated.add(_key(answer))
        ends.append((history + [answer], [_key(m) for m in history] + [_key(answer)],
                     {"tools": request.get("tools"), "call_id": call["call_id"]}))
    prompts = [keys[:-1] for _, keys, _ in ends]
    out = []
    for messages, keys, about in ends:
        if any(len(p) > len(keys) - 1 and p[:len(keys)] == keys for p in prompts):
            continue  # a later call went on from this answer
        for m in messages:
            if m["role"] == "assistant":
                m["weight"] = int(_key(m) in generated)
        out.append({"messages": messages, "tools": about["tools"], "last_call_id": about["call_id"]})
    return out


def write(rows: Iterator[dict[str, Any]], out: Path, fmt: str) -> int:
    """Write records to `out` (jsonl: one JSON object a line; parquet: one file; hf: a `datasets` directory, as
    `Dataset.save_to_disk` writes it); how many. The file is written beside `out` and renamed into place."""
    if fmt not in FORMATS:
        raise ExportError(f"format {fmt!r}: choose one of {', '.join(FORMATS)}")
    out = Path(out)
    tmp = out.with_name(f".tmp-{out.name}")
    try:
        count = _write(rows, tmp, fmt)
        tmp.rename(out)
    finally:
        if tmp.is_dir():
            shutil.rmtree(tmp)
        tmp.unlink(missing_ok=True)
    return count


def _write(rows: Iterator[dict[str, Any]], path: Path, fmt: str) -> int:
    if fmt == "jsonl":
        count = 0
        with open(path, "wb") as f:
            for row in rows:
                f.write(orjson.dumps(row) + b"\n")
                count += 1
        return count
    # Columnar formats want one type a column: tool lists (JSON schemas that differ from tool to tool) as JSON text.
    table = [{**row, "tools": json.dumps(row["tools"])} if row.get("tools") is not None else row for row in rows]
    import pyarrow as pa

    try:
        data = pa.Table.from_pylist(table)
        if "truncation" in data.column_names:  # all [] would make it a list of nulls
            data = data.set_column(data.column_names.index("truncation"), "truncation",
                                   data.column("truncation").cast(pa.list_(pa.string())))
        if fmt == "parquet":
            import pyarrow.parquet as pq

            pq.write_table(data, path)
        else:
            try:
                import datasets
            except ImportError:
                raise ExportError(f"--format hf needs the `datasets` package: {install_hint('data')}, or "
                                  "export jsonl or parquet, which `datasets` also loads") from None
            datasets.Dataset(data).save_to_disk(str(path))
    except pa.ArrowException as exc:
        raise ExportError(f"the records do not fit one {fmt} schema ({exc}): export --format jsonl") from None
    return len(table)


# ---------------------------------------------------------------------------------------------- the parts


def _about(episode: dict[str, Any], run_id: str) -> dict[str, Any]:
    return {"run_id": run_id, "episode_id": episode["episode_id"], "task_id": episode["task_id"],
            "repeat_index": episode["repeat_index"], "reward": episode["reward"]}


def _advantages(all_episodes: list[dict[str, Any]], eps: float = 1e-6) -> dict[str, float]:
    """GRPO advantages, as trainer.maths.algorithms.outcome_advantages computes them: (r - mean) / (std + eps) over the
    judged episodes of each task, std Bessel-corrected; 0 in a group of one or with equal rewards."""
    groups: dict[tuple, list[dict]] = {}
    for e in all_episodes:
        if e["reward"] is not None and e["task_id"] is not None:
            groups.setdefault(group_of(e), []).append(e)
    out = {}
    for members in groups.values():
        rewards = [float(e["reward"]) for e in members]
        flat = len(rewards) < 2 or max(rewards) == min(rewards)
        mean, std = statistics.fmean(rewards), 0.0 if flat else statistics.stdev(rewards)
        for e, r in zip(members, rewards, strict=True):
            out[e["episode_id"]] = 0.0 if flat else (r - mean) / (std + eps)
    return out


def group_of(episode: dict[str, Any]) -> tuple:
    """An episode's GRPO group: its task in the run its outcome belongs to (a harness run, or one training step: a
    whole training run holds every step's episodes of a task, sampled with different weights)."""
    return episode["outcome_run"], episode["task_id"]


def _json(value: Any) -> Any:
    return json.loads(value) if isinstance(value, str) else value


def _message(m: dict[str, Any]) -> dict[str, Any]:
    """A chat message in one shape: text content as a string (text parts joined), tool call arguments as JSON
    text, only the keys a chat message has."""
    content = m.get("content")
    if isinstance(content, list):
        content = "".join(part.get("text", "") for part in content if isinstance(part, dict))
    out: dict[str, Any] = {"role": m.get("role"), "content": content}
    if m.get("tool_calls"):
        out["tool_calls"] = [
            {"id": c.get("id"), "type": "function",
             "function": {"name": (c.get("function") or {}).get("name"),
                          "arguments": _arguments((c.get("function") or {}).get("arguments"))}}
            for c in m["tool_calls"] if isinstance(c, dict)]
    for key in ("tool_call_id", "name"):
        if m.get(key) is not None:
            out[key] = m[key]
    return out


def _arguments(arguments: Any) -> str:
    return arguments if isinstance(arguments, str) else json.dumps(arguments or {}, ensure_ascii=False)


def _key(m: dict[str, Any]) -> bytes:
    """What makes two messages the same turn: role, text (an agent may trim the whitespace around a reply it sends
    back) and tool calls (arguments compared as JSON values)."""
    calls = [(c["function"]["name"], parsed_arguments(c["function"]["arguments"])) for c in m.get("tool_calls") or []]
    return orjson.dumps([m["role"], (m.get("content") or "").strip(), calls, m.get("tool_call_id")],
                        option=orjson.OPT_SORT_KEYS)


def parsed_arguments(arguments: Any) -> Any:
    """Tool call arguments as a JSON value: JSON text parsed, anything else (a dict, text that is not JSON) as is."""
    try:
        return json.loads(arguments) if isinstance(arguments, str) else arguments
    except ValueError:
        return arguments
