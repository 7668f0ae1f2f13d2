"""What a new user meets in the first hour with a real model (issue: doctor, parsers, the CLI's edges): `harness
parsers`, doctor on a Hub id without its weights, a clean log, and a closed pipe that is not a traceback."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from harness.cli.main import main
from proxy.parsing.families import REASONING_PARSER_FAMILIES, TOOL_PARSER_FAMILIES
from proxy.parsing.native import REASONING_PARSERS, TOOL_PARSERS


def _harness(*args: str, env: dict[str, str] | None = None, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "harness.cli", *args], capture_output=True, text=True, timeout=300,
                          env={**os.environ, **(env or {})}, **kwargs)


def test_parsers_lists_every_name_with_its_families(capsys):
    assert main(["parsers"]) == 0
    out = capsys.readouterr().out.splitlines()
    tools_at, reasoning_at = out.index(next(x for x in out if x.startswith("tool parsers"))), out.index(
        next(x for x in out if x.startswith("reasoning parsers")))
    tools = {line.split()[0]: line.split(None, 1)[1] for line in out[tools_at + 1:reasoning_at]}
    reasoning = {line.split()[0]: line.split(None, 1)[1] for line in out[reasoning_at + 1:]}
    assert list(tools) == list(TOOL_PARSERS) and list(reasoning) == list(REASONING_PARSERS)
    assert "3.3" in tools["llama3_json"] and "Qwen2.5" in tools["hermes"] and "V3.1" in tools["deepseek_v31"]
    assert "distill" in reasoning["deepseek_r1"].lower()
    assert main(["parsers", "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == {"tool": TOOL_PARSER_FAMILIES, "reasoning": REASONING_PARSER_FAMILIES}


def test_parsers_with_a_model_lists_those_that_load_with_its_tokenizer(tiny_model_dir, tmp_path, capsys):
    pytest.importorskip("vllm")
    from tests.families import FAMILIES

    llama = FAMILIES["llama3.1"].build(tmp_path / "llama")
    assert main(["parsers", "--model", str(tiny_model_dir), "--json"]) == 0
    tiny = json.loads(capsys.readouterr().out)
    assert main(["parsers", "--model", str(llama), "--json"]) == 0
    with_python_tag = json.loads(capsys.readouterr().out)
    # llama3_json needs <|python_tag|>, which the Llama family's vocabulary has and the tiny Qwen2 model's lacks
    assert "llama3_json" in with_python_tag["tool"] and "llama3_json" not in tiny["tool"]
    assert "hermes" in tiny["tool"] and set(tiny["tool"]) < set(TOOL_PARSERS)
    assert main(["parsers", "--model", str(tmp_path / "nowhere")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: --model") and "nowhere" in err and len(err.splitlines()) == 1


def test_doctor_prints_no_vllm_info_lines(tiny_model_dir):
    done = _harness("doctor", "--model", str(tiny_model_dir))
    assert done.returncode == 0, done.stderr
    assert not [line for line in done.stderr.splitlines() if " INFO " in line], done.stderr


def test_doctor_on_a_hub_id_fetches_the_tokenizer_and_template_only(tiny_model_dir, tmp_path):
    """No weights: the fake Hub (a real HTTP server speaking the Hub's download API) sees no safetensors asked for,
    and doctor's report is the one the local directory gets."""
    from tests.running.hub_server import FakeHub

    with FakeHub() as hub:
        hub.add("org/tiny", tiny_model_dir)
        done = _harness("doctor", "--model", "org/tiny", "--json", cwd=tmp_path,
                        env={"HF_ENDPOINT": hub.url, "HF_HUB_CACHE": str(tmp_path / "cache"), "HF_HUB_OFFLINE": "0"})
        fetched = hub.downloads("org/tiny")
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["ok"] is True
    assert "tokenizer_config.json" in fetched and "config.json" in fetched
    assert not [name for name in fetched if name.endswith((".safetensors", ".bin"))], fetched
    assert any(path.name.endswith(".safetensors") for path in tiny_model_dir.iterdir())  # there were weights to skip


def test_a_closed_pipe_ends_the_command_quietly(tmp_path):
    """`harness train --show-config | head` closed the pipe under a long listing: exit as a shell's SIGPIPE, no
    traceback."""
    process = subprocess.Popen([sys.executable, "-m", "harness.cli", "train", "--show-config"],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    process.stdout.close()  # the reader is gone before the first line
    err = process.stderr.read().decode()
    assert process.wait(timeout=120) == 141 and "Traceback" not in err and "BrokenPipe" not in err, err
