"""`harness doctor` reports what in a chat template breaks merging, with positions, and exits 0 / 1 / 2."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest

from harness.cli.doctor import FAIL, OK, WARN, DoctorError, Report, diagnose, format_report
from harness.cli.main import main
from harness.running.tiny_model import CHAT_TEMPLATE

pytest.importorskip("transformers")

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json")

# Qwen3-style: assistant turns before the last user message lose their <think>...</think> block.
_LAST_USER = ("{%- set ns = namespace(last_user=-1) %}\n{%- for m in messages %}{%- if m.role == 'user' %}"
              "{%- set ns.last_user = loop.index0 %}{%- endif %}{%- endfor %}\n")
_PLAIN_TURN = "{{- '<|im_start|>' + message.role + '\\n' + (message.content or '') + '<|im_end|>' + '\\n' }}"
_THINK_DROPPED = ("{%- set content = message.content or '' %}\n"
                  "{%- if message.role == 'assistant' and loop.index0 < ns.last_user and '</think>' in content %}"
                  "{%- set content = content.split('</think>')[-1].lstrip('\\n') %}{%- endif %}\n"
                  "{{- '<|im_start|>' + message.role + '\\n' + content + '<|im_end|>' + '\\n' }}")
assert _PLAIN_TURN in CHAT_TEMPLATE
QWEN3_STYLE = _LAST_USER + CHAT_TEMPLATE.replace(_PLAIN_TURN, _THINK_DROPPED)
TRIMS_CONTENT = CHAT_TEMPLATE.replace("(message.content or '')", "((message.content or '') | trim)")
OTHER_TOOL_FORMAT = CHAT_TEMPLATE.replace('\'", "arguments": \'', '\'", "parameters": \'')
ENDOFTEXT_TURNS = CHAT_TEMPLATE.replace("<|im_end|>", "<|endoftext|>")
assert len({CHAT_TEMPLATE, QWEN3_STYLE, TRIMS_CONTENT, OTHER_TOOL_FORMAT, ENDOFTEXT_TURNS}) == 5


@pytest.fixture(scope="module")
def tiny_report(tiny_model_dir) -> Report:
    return diagnose(tiny_model_dir)


def _checks(report: Report) -> dict:
    return {c.name: c for c in report.checks}


def _with_template(tmp_path, template: str):
    path = tmp_path / "template.jinja"
    path.write_text(template, encoding="utf-8")
    return path


def _copy_tokenizer(tiny_model_dir, dest, template: str | None, generation_config: bool = True):
    """The tiny model's tokenizer files with another template (None: no template at all)."""
    dest.mkdir()
    for name in TOKENIZER_FILES:
        if name == "generation_config.json" and not generation_config:
            continue
        shutil.copy(tiny_model_dir / name, dest / name)
    config = json.loads((dest / "tokenizer_config.json").read_text())
    config.pop("chat_template")
    if template is None:
        (dest / "chat_template.jinja").unlink()
    else:
        (dest / "chat_template.jinja").write_text(template, encoding="utf-8")
    (dest / "tokenizer_config.json").write_text(json.dumps(config))
    return dest


def test_tiny_model_passes_and_its_drift_is_named(tiny_report):
    """The tiny template only appends and the hermes parser reads it back; what does drift (text before a tool
    call comes back with an extra newline; compact arguments come back spaced) is a warning, not a failure."""
    checks = _checks(tiny_report)
    assert list(checks) == ["append-only", "history", "tool-parser", "reasoning", "close-token"]
    assert checks["reasoning"].status == OK and "does not render" in checks["reasoning"].summary
    assert not tiny_report.failed
    assert checks["append-only"].status == OK
    assert checks["tool-parser"].status == OK
    assert checks["close-token"].status == OK
    assert '"<|im_end|>"' in checks["close-token"].summary and '"\\n"' in checks["close-token"].summary
    history = checks["history"]
    assert history.status == WARN and "Token-exact continuity" in history.advice
    by_probe = {f.where: f for f in history.findings}
    before_call = by_probe["text before a tool call, echoed back"]
    assert (before_call.level, before_call.before[-14:]) == ("text", "Let me check.\n")
    assert before_call.expected.startswith("<tool_call>") and before_call.found.startswith("\n<tool_call>")
    compact = by_probe["arguments written compactly, echoed back"]
    assert compact.expected.startswith('"Paris",') and compact.found.startswith(' "Paris", ')
    assert "a reply with a <think> block" not in by_probe  # the tiny template keeps what the model wrote


def test_a_think_block_left_in_the_content_comes_back_without_it(tiny_model_dir, tmp_path):
    """Without a reasoning parser the model's <think> block reaches the agent as content; a Qwen3-style template
    drops it once a user message follows: a history warning, where the reply came back shorter."""
    report = diagnose(tiny_model_dir, chat_template=_with_template(tmp_path, QWEN3_STYLE))
    checks = _checks(report)
    assert not report.failed and checks["append-only"].status == OK
    think = {f.where: f for f in checks["history"].findings}["a reply with a <think> block"]
    assert think.expected.startswith("<think>\nLook it up") and think.found.startswith("It is 21")


def test_qwen3_reasoning_is_placed_and_the_choice_that_fits_is_named(tiny_model_dir, tmp_path):
    """With the qwen3 reasoning parser, doctor finds where the template renders reasoning_content: in the tool
    loop, not after the next user message, so as_rendered fits."""
    from tests.families import FAMILIES

    report = diagnose(tiny_model_dir, chat_template=_with_template(tmp_path, FAMILIES["qwen3"].template),
                      reasoning_parser="qwen3")
    checks = _checks(report)
    assert not report.failed, format_report(report)
    assert checks["reasoning"].status == OK and "as_rendered (the default) fits" in checks["reasoning"].summary
    assert "a reply with a <think> block" not in {f.where for f in checks["history"].findings}
    assert "reasoning parser: qwen3" in format_report(report).splitlines()[0]
    kept = _with_template(tmp_path, FAMILIES["qwen3"].template.replace("loop.index0 > ns.last_query and ", ""))
    summary = _checks(diagnose(tiny_model_dir, chat_template=kept, reasoning_parser="qwen3"))["reasoning"].summary
    assert "both reasoning_history choices merge" in summary


def test_template_that_trims_content_warns_with_the_position(tiny_model_dir, tmp_path):
    report = diagnose(tiny_model_dir, chat_template=_with_template(tmp_path, TRIMS_CONTENT))
    checks = _checks(report)
    assert checks["append-only"].status == OK  # consistent with itself: it trims every time
    finding = {f.where: f for f in checks["history"].findings}["a reply with surrounding newlines"]
    assert finding.level == "text" and finding.before.endswith("assistant\n")
    assert finding.expected.startswith("\nIt is 21") and finding.found.startswith("It is 21")


def test_tool_calls_the_parser_cannot_read_fail(tiny_model_dir, tmp_path):
    report = diagnose(tiny_model_dir, chat_template=_with_template(tmp_path, OTHER_TOOL_FORMAT))
    parser_check = _checks(report)["tool-parser"]
    assert report.failed and parser_check.status == FAIL
    assert len(parser_check.findings) == 3  # the three assistant turns with tool calls
    assert all("parameters" in f.what and f.found == "[]" for f in parser_check.findings)


def test_close_token_must_be_a_stop_token(tiny_model_dir, tmp_path):
    with_config = _copy_tokenizer(tiny_model_dir, tmp_path / "gen", ENDOFTEXT_TURNS)
    close = _checks(diagnose(with_config))["close-token"]
    assert close.status == OK and "generation_config.json" in close.summary
    without = _copy_tokenizer(tiny_model_dir, tmp_path / "nogen", ENDOFTEXT_TURNS, generation_config=False)
    close = _checks(diagnose(without))["close-token"]
    assert close.status == FAIL and '"<|endoftext|>' in close.summary and "generation_config.json" in close.advice


# --- the command -----------------------------------------------------------------------------------------------


def test_doctor_command_prints_one_line_per_check_and_exits_0(tiny_model_dir):
    done = subprocess.run([sys.executable, "-m", "harness.cli", "doctor", "--model", str(tiny_model_dir)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    statuses = [line.split()[:2] for line in done.stdout.splitlines() if line[:1] in ("o", "w", "F")]
    assert statuses == [["ok", "append-only"], ["warn", "history"], ["ok", "tool-parser"], ["ok", "reasoning"],
                        ["ok", "close-token"]]


def test_doctor_json_and_exit_1_on_failure(tiny_model_dir, tmp_path, capsys):
    template = _with_template(tmp_path, OTHER_TOOL_FORMAT)
    assert main(["doctor", "--model", str(tiny_model_dir), "--chat-template", str(template), "--json"]) == 1
    out = json.loads(capsys.readouterr().out)
    assert out["ok"] is False and out["tool_parser"] == "hermes"
    parser_check = next(c for c in out["checks"] if c["name"] == "tool-parser")
    assert parser_check["status"] == "FAIL" and parser_check["findings"][0]["found"] == "[]"
    assert main(["doctor", "--model", str(tiny_model_dir), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["ok"] is True


@pytest.mark.parametrize(
    ("case", "message"),
    [
        ("missing", "is not a directory"),
        ("empty", "no tokenizer in"),
        ("no template", "has no chat template"),
        ("bad parser", "unknown tool parser 'nope': use one of"),
        ("bad template file", "is not a file"),
    ],
)
def test_bad_input_is_one_clear_line_and_exit_2(tiny_model_dir, tmp_path, capsys, case, message):
    model, extra = tiny_model_dir, []
    if case == "missing":
        model = tmp_path / "no-such-model"
    elif case == "empty":
        model = tmp_path / "empty"
        model.mkdir()
    elif case == "no template":
        model = _copy_tokenizer(tiny_model_dir, tmp_path / "bare", None)
    elif case == "bad parser":
        extra = ["--tool-parser", "nope"]
    else:
        extra = ["--chat-template", str(tmp_path / "none.jinja")]
    assert main(["doctor", "--model", str(model), *extra]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and message in err and len(err.splitlines()) == 1


def test_doctor_help_answers(capsys):
    with pytest.raises(SystemExit) as exited:
        main(["doctor", "--help"])
    assert exited.value.code == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "usage: harness doctor" in out and "--tools" in out
    assert "from the local cache, else downloaded" in out  # what the command does with a Hub id (docs/doctor.md)


def test_a_model_without_tool_format_is_for_agents_without_tools(smollm2_dir):
    """SmolLM2's template has no tool-call format: doctor says the model suits agents without tools, warns and exits
    0, having said on stderr what it loads before the wait; asked for tools, the same template FAILs with exit 1."""
    done = subprocess.run([sys.executable, "-m", "harness.cli", "doctor", "--model", str(smollm2_dir)],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    line = next(x for x in done.stdout.splitlines() if x.split()[1:2] == ["tool-parser"])
    assert line.startswith("warn ") and "use this model for agents without tools" in line, line
    assert "harness doctor --tools" in " ".join(done.stdout.split())  # how to check strictly
    assert not [x for x in done.stdout.splitlines() if x.startswith("FAIL")], done.stdout
    assert done.stderr.splitlines()[0].startswith("doctor: loading the tokenizer and vLLM's parsers"), done.stderr
    strict = subprocess.run([sys.executable, "-m", "harness.cli", "doctor", "--model", str(smollm2_dir), "--tools"],
                            capture_output=True, text=True, timeout=600)
    assert strict.returncode == 1, strict.stdout + strict.stderr
    line = next(x for x in strict.stdout.splitlines() if x.split()[1:2] == ["tool-parser"])
    assert line.startswith("FAIL ") and "writes no tool calls at all" in line, line


def test_naming_a_tool_parser_asks_for_tools(smollm2_dir, capsys):
    assert main(["doctor", "--model", str(smollm2_dir), "--tool-parser", "hermes", "--json"]) == 1
    out = json.loads(capsys.readouterr().out)
    assert out["tools"] is True and out["ok"] is False
    assert next(c for c in out["checks"] if c["name"] == "tool-parser")["status"] == "FAIL"


def test_doctor_takes_a_cached_hub_id(tiny_model_dir, tmp_path, monkeypatch, capsys):
    from tests.running.hub_cache import cache_model

    cache_model(tmp_path / "hf-cache", "org/tiny", tiny_model_dir)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hf-cache"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert main(["doctor", "--model", "org/tiny", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["ok"] is True
    assert main(["doctor", "--model", "org/not-cached"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "org/not-cached" in err and "hf download" in err and len(err.splitlines()) == 1


# Formats whose calls open a reply (vLLM's llama3_json and pythonic parsers read them only there): a turn with text
# before its calls is read as the engine reads it, and doctor says so without failing the parser.
CALLS_OPEN_A_REPLY = {"llama3.1", "llama3.2-pythonic"}


def _wrong_parser(right: str) -> str:
    return "hermes" if right == "pythonic" else "pythonic"


@pytest.fixture(scope="module")
def family_models(tmp_path_factory):
    from tests.families import FAMILIES

    root = tmp_path_factory.mktemp("families")
    return {name: (family, family.build(root / name)) for name, family in FAMILIES.items()}


def test_the_tool_parser_verdict_per_family(family_models):
    """The verdict table, for every model family of the engine tests (tests/families): the family's own parser reads
    back every turn its template writes (ok, exit 0 as far as this check goes), also where the format has no place
    for text before a call (the turn is named, read as the engine reads it) and where the template leaves that text
    out (Mistral v3); a wrong parser FAILs, naming the turns, what it read, and the family's parser among those
    that do read them."""
    table = {}
    for name, (family, model) in family_models.items():
        right = _checks(diagnose(model, tool_parser=family.tool_parser, reasoning_parser=family.reasoning_parser))
        wrong_name = _wrong_parser(family.tool_parser)
        wrong = _checks(diagnose(model, tool_parser=wrong_name, reasoning_parser=family.reasoning_parser))
        table[name] = (right["tool-parser"].status, wrong["tool-parser"].status)
        assert right["tool-parser"].status == OK, (name, right["tool-parser"])
        limits = [f.where for f in right["tool-parser"].findings]
        assert limits == (["tool calls and results, assistant message 4"] if name in CALLS_OPEN_A_REPLY else []), name
        assert wrong["tool-parser"].status == FAIL, (name, wrong_name, wrong["tool-parser"])
        assert wrong["tool-parser"].findings and all(f.found is not None for f in wrong["tool-parser"].findings)
        named = wrong["tool-parser"].advice.split("every turn this template writes: ")[1].split(";")[0].split(", ")
        assert family.tool_parser in named and wrong_name not in named, (name, wrong["tool-parser"].advice)
        assert right["close-token"].status == OK, name
        # every family's template only appends, but Mistral v3's, which moves the tool list to the last user
        # message; templates that leave a turn open (GLM's) continue with the stop token the model sampled
        assert (right["append-only"].status == OK) == (name != "mistral"), name
    assert set(table.values()) == {(OK, FAIL)} and len(table) >= 10


def test_a_parser_the_tokenizer_cannot_load_names_the_model_and_the_ones_that_load(family_models):
    qwen = family_models["qwen2.5"][1]
    with pytest.raises(DoctorError, match=r"llama3_json' cannot be used with the tokenizer.*<\|python_tag\|>") as exc:
        diagnose(qwen, tool_parser="llama3_json")  # vLLM refuses a parser whose tokens the vocabulary lacks
    message = str(exc.value)
    assert repr(str(qwen)) in message and "None" not in message
    loading = message.split("load with this tokenizer: ")[1].split(";")[0].split(", ")
    assert "hermes" in loading and "llama3_json" not in loading
    assert "--tool-parser" in message and "harness parsers" in message


def test_a_reasoning_parser_always_gets_a_reasoning_history_to_use(tiny_model_dir, family_models):
    """Whatever the template does with reasoning, a reasoning parser gets one reasoning_history named: the tiny
    model's template renders none (which left both choices described and neither picked), the families' their own."""
    never = _checks(diagnose(tiny_model_dir, reasoning_parser="qwen3"))["reasoning"]
    assert never.status == WARN and "does not render" in never.summary and "as_rendered fits" in never.summary
    assert never.advice.startswith("Use reasoning_history as_rendered")
    reasoning = [(name, model, family.reasoning_parser) for name, (family, model) in family_models.items()
                 if family.reasoning_parser]
    assert len(reasoning) >= 2
    for name, model, parser in reasoning:
        check = _checks(diagnose(model, tool_parser=family_models[name][0].tool_parser,
                                 reasoning_parser=parser))["reasoning"]
        assert "as_rendered" in check.summary and ("fits" in check.summary or "keep the default" in check.summary), (
            name, check)
