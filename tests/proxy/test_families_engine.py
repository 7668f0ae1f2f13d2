"""Every model family's tool-call format (and reasoning format) through the proxy against the real engine.

For each family of tests/families: the tiny model speaks the family's format, vLLM serves it with the family's
`--tool-call-parser` (and `--reasoning-parser`), and an OpenAI-SDK agent holds a three-turn tool conversation
through the proxy, whole and streamed: two tool calls, each answered, then a short text. The replies are forced
(a regex of the family's exact text), so the same text comes out on every path, and:
- the agent gets, from the proxy's token-exact path, the message the engine's own chat endpoint gives for the same
  request (content, tool calls, reasoning);
- the episode merges into one sample with no drift, every sampled token trained (mask 1), thinking included.
"""

from __future__ import annotations

import contextlib
import json
import re
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import openai
import pytest

from harness.core.merge import FIRST_CALL, merge_episode
from harness.running.proxied import engine_parsing
from harness.running.vllm_server import start_vllm
from harness.store.database import Store
from tests.families import FAMILIES, Family
from tests.families.talk import ask
from tests.support import LONG_TESTS, RunningProxy, long_run

pytestmark = pytest.mark.engine

FINAL = "The total is 9."


def _forced(family: Family, turn: int) -> str:
    """The exact reply of each turn: a call of add(a=turn+1), then the final text; reasoning first if the family
    reasons."""
    text = family.reply("add", {"a": turn + 1}) if turn < 2 else FINAL
    if family.reasoning_parser:
        text = f"<think>\nStep {turn}: I add.\n</think>\n\n" + text
    return text


def _conversation(base_url: str, family: Family, stream: bool, bias: dict) -> list[tuple[list[dict], dict]]:
    """The agent's three turns: (the messages it sent, the answer it got)."""
    client = openai.OpenAI(base_url=base_url, api_key="sk-test", max_retries=0)
    messages = [{"role": "system", "content": "You add numbers."}, {"role": "user", "content": "Add two numbers."}]
    turns = []
    for turn in range(3):
        answer = ask(client, messages, re.escape(_forced(family, turn)), stream, bias)
        turns.append(([dict(m) for m in messages], answer))
        message = {"role": "assistant", "content": answer["content"]}
        if answer["reasoning"]:
            message["reasoning_content"] = answer["reasoning"]
        if answer["calls"]:
            message["tool_calls"] = [{"id": i, "type": "function", "function": {"name": n, "arguments": json.dumps(a)}}
                                     for i, (n, a) in zip(answer["ids"], answer["calls"], strict=True)]
        messages.append(message)
        for call_id in answer["ids"]:
            messages.append({"role": "tool", "tool_call_id": call_id, "content": str(turn + 7)})
    return turns


def _same_message(a: dict, b: dict) -> bool:
    """The same message as a client reads it: text stripped, and no text (a whole answer's None, a stream's
    whitespace between its reasoning and its call) alike."""
    keys = ("content", "reasoning", "calls", "finish")
    return {k: ((a[k].strip() or None) if isinstance(a[k], str) else a[k]) for k in keys} == {
        k: ((b[k].strip() or None) if isinstance(b[k], str) else b[k]) for k in keys}


# open-turns is GLM-4's turn layout with Hermes calls; glm4.5 runs that layout with its own parsers here (doctor
# still checks both)
ORDER = sorted(name for name in FAMILIES if name != "open-turns")
# CI runs Qwen3 (Hermes tags with reasoning, on the session's engine: no engine of its own to start, CI time);
# `make test-long` runs every family, each on an engine of its own. Each family's parsers are also checked without an
# engine in the fast tier (test_vllm_parsing.py, test_doctor.py), so what CI leaves out here is the engine's own chat
# endpoint agreeing with the proxy's token-exact path for the others.
IN_CI = ("qwen3",)


class _Engines:
    """Each family's engine with its parsers, started one family ahead in a background thread: most of a start is
    vLLM importing itself, which overlaps the conversation of the family before."""

    def __init__(self, root: Path):
        self.root = root
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="family-engine")
        self.starting: dict[str, Future] = {}

    def _start(self, family: Family):
        model = family.build(self.root / family.name)
        # the forcing regex covers the thinking too: vLLM applies it after reasoning ends unless told otherwise
        forcing = ["--structured-outputs-config", '{"enable_in_reasoning": true}'] if family.reasoning_parser else []
        engine = start_vllm(model, self.root / f"engine-{family.name}", tool_parser=family.tool_parser,
                            reasoning_parser=family.reasoning_parser, extra_args=forcing,
                            env={"VLLM_ENABLE_V1_MULTIPROCESSING": "0"})  # its core in-process: 5 s less a start
        return engine, family.marker_bias(model)

    def _ahead(self, name: str) -> None:
        if name not in self.starting and name != "qwen3":  # qwen3: the session's engine (tests/conftest.py)
            self.starting[name] = self.pool.submit(self._start, FAMILIES[name])

    def take(self, name: str):
        """(engine, marker bias) of `name`, the caller's to stop; the next family's engine starts meanwhile."""
        self._ahead(name)
        later = [n for n in ORDER[ORDER.index(name) + 1:] if n in IN_CI or LONG_TESTS]
        if later:
            self._ahead(later[0])
        return self.starting.pop(name).result()

    def close(self) -> None:
        for future in self.starting.values():  # started ahead for a family that did not run (-k)
            with contextlib.suppress(Exception):
                future.result()[0].stop()
        self.pool.shutdown()


@pytest.fixture(scope="module")
def family_engines(tmp_path_factory):
    engines = _Engines(tmp_path_factory.mktemp("families"))
    yield engines
    engines.close()


@contextlib.contextmanager
def _served(family: Family, request):
    """(engine, marker bias) for the family: the session's Qwen3 engine, else its own."""
    if family.name == "qwen3":
        yield request.getfixturevalue("qwen3_engine")
        return
    engine, bias = request.getfixturevalue("family_engines").take(family.name)
    try:
        yield engine, bias
    finally:
        engine.stop()


@pytest.mark.parametrize("name", [name if name in IN_CI else pytest.param(name, marks=long_run) for name in ORDER])
def test_a_family_tool_conversation_is_token_exact_and_parsed_as_the_engine_parses(name, tmp_path, request):
    family = FAMILIES[name]
    with _served(family, request) as (engine, bias):
        proxy = RunningProxy(engine.base_url, tmp_path / "rec.duckdb", served_model=engine.served_model,
                             **engine_parsing(engine))
        try:
            got = {stream: _conversation(f"{proxy.url}/e/{name}-{stream}/v1", family, stream, bias)
                   for stream in (False, True)}
        finally:
            proxy.close()
        direct = openai.OpenAI(base_url=f"{engine.base_url}/v1", api_key="sk-test", max_retries=0)
        for stream, turns in got.items():
            for turn, (messages, answer) in enumerate(turns):
                # the engine's whole answer is the reference for both: its own stream garbles some families' calls
                # when it is busy enough to send several tokens a piece (the proxy's does not: test_vllm_parsing.py)
                expected = ask(direct, messages, re.escape(_forced(family, turn)), False, bias, engine.served_model)
                assert _same_message(answer, expected), (stream, turn, answer, expected)
                assert bool(answer["calls"]) == (turn < 2), answer
                assert answer["finish"] == ("tool_calls" if turn < 2 else "stop")
                if family.reasoning_parser:
                    assert answer["reasoning"].strip() == f"Step {turn}: I add."

    with Store.open(tmp_path / "rec.duckdb", read_only=True) as store:
        for stream in (False, True):
            calls = store.load_calls(f"{name}-{stream}")
            assert [c.extra["continuity"]["mode"] for c in calls] == ["chat", "token_exact", "token_exact"], [
                c.extra.get("continuity") for c in calls]
            assert not any(c.extra.get("flags") for c in calls), [c.extra.get("flags") for c in calls]
            # each reply ended on the family's own close token, which the next prompt continues after
            assert not any(c.extra["continuity"].get("synthetic_close") for c in calls), [c.extra for c in calls]
            merged = merge_episode(calls)
            assert [b.reason for b in merged.breaks] == [FIRST_CALL]
            (sample,) = merged.samples
            mask = [0] * len(sample.token_ids)
            for call in calls:  # every sampled token, thinking included, is trained exactly where it was sampled
                start, ids = len(call.prompt_ids), call.choices[0].completion_ids
                assert sample.token_ids[start:start + len(ids)] == ids
                mask[start:start + len(ids)] = [1] * len(ids)
            assert sample.loss_mask == mask
