"""Codex CLI and Claude Code, unmodified, on the real engine: vLLM serving the tiny model with a 32k context (their
prompts are 18k and 24k tokens of its vocabulary), whose replies a logits processor forces to the tool calls a
coding task needs (tests/forcing.py); everything else is real: the engine's template, ids and logprobs, the
proxy's token-exact continuity over the history each CLI resends, and the merge. Each CLI runs its shell tool twice
and finishes with exit 0; its three calls merge into one sample with no drift."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from harness.core.merge import merge_episode
from harness.running.tiny_model import build_tiny_model
from harness.running.vllm_server import start_vllm
from harness.store.database import Store
from proxy import SamplingOverrides
from tests.proxy.test_coding_agents import BIN, _codex_home, _installed
from tests.support import RunningProxy

ROOT = Path(__file__).resolve().parents[2]
CONTEXT = 32768


def _call(name: str, arguments: dict) -> str:
    """A Hermes tool call, as the tiny model's template writes one."""
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": arguments}) + "\n</tool_call>"


REPLIES = {  # per agent: two shell calls, then the answer
    "codex": [_call("exec_command", {"cmd": "echo hello > out.txt"}), _call("exec_command", {"cmd": "cat out.txt"}),
              "done: out.txt says hello"],
    "claude": [_call("Bash", {"command": "echo hello > out.txt", "description": "Write it"}),
               _call("Bash", {"command": "cat out.txt", "description": "Show it"}), "done: out.txt says hello"],
}


@pytest.fixture(scope="module")
def forced_engine(tmp_path_factory):
    """The tiny model with a 32k context, served by vLLM with the forcing processor; (engine, model, replies file)."""
    root = tmp_path_factory.mktemp("long")
    model = build_tiny_model(root / "tiny-32k", seed=0)
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "max_position_embeddings": CONTEXT}))
    replies = root / "replies.json"
    engine = start_vllm(model, root / "engine", max_model_len=CONTEXT,
                        extra_args=["--logits-processors", "tests.forcing:ScriptedReplies"],
                        env={"HARNESS_SCRIPTED_REPLIES": str(replies), "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
                             "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))})
    yield engine, model, replies
    engine.stop()


@pytest.mark.parametrize("agent", ["codex", "claude"])
def test_a_coding_cli_on_the_real_engine_merges_into_one_sample(agent, forced_engine, tmp_path):
    _installed(agent)
    engine, model, replies = forced_engine
    replies.write_text(json.dumps(REPLIES[agent]))
    db = tmp_path / "rec.duckdb"
    # Claude Code asks for max_tokens 128000, more than the whole context: capped, as its README says to serve it
    proxy = RunningProxy(engine.base_url, db, served_model=engine.served_model, tokenizer=str(model),
                         sampling=SamplingOverrides(max_tokens_cap=512))
    scratch, home = tmp_path / "scratch", tmp_path / "home"
    scratch.mkdir()
    home.mkdir()
    try:
        if agent == "codex":
            command = [str(BIN / "codex"), "exec", "--skip-git-repo-check",
                       "--dangerously-bypass-approvals-and-sandbox", "--disable", "plugins",
                       "write hello into out.txt and show it"]
            env = {"CODEX_HOME": str(_codex_home(tmp_path, f"{proxy.url}/e/{agent}/v1")), "HARNESS_KEY": "sk-any"}
        else:
            command = [str(BIN / "claude"), "-p", "write hello into out.txt and show it",
                       "--dangerously-skip-permissions"]
            env = {"HOME": str(home), "ANTHROPIC_BASE_URL": f"{proxy.url}/e/{agent}", "ANTHROPIC_API_KEY": "sk-any",
                   "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1", "DISABLE_AUTOUPDATER": "1", "IS_SANDBOX": "1"}
        done = subprocess.run(command, cwd=scratch, capture_output=True, text=True, timeout=600,
                              stdin=subprocess.DEVNULL, env={**os.environ, **env})
    finally:
        proxy.close()
    assert done.returncode == 0, (done.stdout[-2000:], done.stderr[-3000:])
    assert json.loads(replies.read_text()) == []  # every scripted reply was asked for
    assert (scratch / "out.txt").read_text() == "hello\n"
    assert "done: out.txt says hello" in done.stdout
    with Store.open(db) as store:
        calls = store.load_calls(agent)
        merged = merge_episode(calls)
    assert [c.status for c in calls] == ["ok", "ok", "ok"]
    assert all(c.prompt_ids and c.choices[0].completion_ids for c in calls)  # the engine's own ids
    modes = [(c.extra.get("continuity") or {}).get("mode") for c in calls]
    assert modes[1:] == ["token_exact", "token_exact"], [c.extra.get("continuity") for c in calls]
    (sample,) = merged.samples
    assert merged.n_drift == 0 and sample.call_ids == [c.call_id for c in calls]
    for call in calls:  # every reply trained exactly as sampled
        start, ids = len(call.prompt_ids), call.choices[0].completion_ids
        assert sample.token_ids[start:start + len(ids)] == ids and set(sample.loss_mask[start:start + len(ids)]) == {1}
