"""`harness doctor`: does a model's chat template let multi-turn agent calls merge into one token sequence?

Merging (harness/core/merge.py) joins call k+1 to call k when call k+1's prompt ids start with call k's prompt ids +
its completion ids. That holds only if the chat template renders each longer conversation by appending to the
shorter one, and renders an earlier assistant turn exactly as the model wrote it. Five checks, run offline on
the tokenizer and template alone (no engine, no weights):

1. append-only: the template against itself. Over representative conversations (text replies, one and two
   tool calls, tool results, a second user turn; with and without tools offered), the prompt
   of the call before each assistant turn + that turn as the template renders it (up to its close token) must be
   a prefix of the next call's prompt, as text and as token ids.
2. history: what the model wrote against how the template re-renders it once the agent sends it back (through
   vLLM, which parses tool-call arguments into objects): text before a tool call, compact arguments,
   surrounding newlines, a <think> block.
3. tool-parser: what the template renders for assistant tool calls parses back, with the parser the engine and
   the proxy use (vLLM's own where vLLM is installed: proxy/parsing/), to the same names, arguments and content.
4. reasoning: where the template renders a reply's reasoning (`reasoning_content`): for the latest turn, inside
   its tool loop, after a new user message; and so which `reasoning_history` choice fits (docs/proxy.md).
5. close-token: the token that ends an assistant turn is a stop token of the model (tokenizer eos or
   generation_config.json), so a sampled reply ends exactly where the template's turn ends; the text the
   template writes after it is glue: context, never trained.

A FAIL breaks merging or the proxy's answers for every agent; a warn depends on what the model writes or the
agent sends back, or on whether the agents use tools (a template with no tool-call format at all suits agents without
tools: a FAIL only when tools were asked for, `diagnose(tools=True)`). The conversations, the rendering and the
reading back that the checks share are in harness/cli/doctor_render.py, the reading of the model's files in
harness/cli/doctor_input.py. transformers is imported inside `load_tokenizer`: the harness core imports without it.
"""

from __future__ import annotations

import json
import logging
import textwrap
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from harness.cli.doctor_input import DoctorError, check_input, load_tokenizer, stop_ids
from harness.cli.doctor_render import (
    CONTEXT_CHARS,
    CONVERSATIONS,
    NAMED_ID_PARSERS,
    NEXT_USER,
    SYSTEM,
    TOOLS,
    Divergence,
    Finding,
    Reader,
    RenderError,
    Template,
    ToolTurn,
    assistant,
    read_turn,
    show,
    tool_result,
    tool_turns,
    user,
)
from proxy.parsing import reply_parsing
from proxy.parsing.native import check_reasoning_parser

__all__ = ["Check", "DoctorError", "Finding", "Report", "diagnose", "format_report", "load_tokenizer"]

OK, WARN, FAIL = "ok", "warn", "FAIL"

TOKEN_EXACT = ("Token-exact continuity (the proxy's default when the engine returns token ids) builds each prompt "
               "from the recorded ids and does not depend on this.")


@dataclass(frozen=True)
class Check:
    name: str  # append-only, history, tool-parser, reasoning, close-token
    status: str  # ok, warn or FAIL
    summary: str  # one line, plain words
    findings: tuple[Finding, ...] = ()
    advice: str = ""  # what breaks and what to do; empty when ok


@dataclass(frozen=True)
class Report:
    model: str
    template: str  # "the model's own", or the file passed with --chat-template
    tool_parser: str
    checks: tuple[Check, ...]
    reasoning_parser: str | None = None
    notes: tuple[str, ...] = field(default=())  # conversations the template could not render, and the like
    tools: bool = True  # whether tool use was checked strictly (the agents use tools; see check_tool_parser)

    @property
    def failed(self) -> bool:
        return any(c.status == FAIL for c in self.checks)

    def to_json(self) -> dict:
        return {"model": self.model, "template": self.template, "tool_parser": self.tool_parser,
                "reasoning_parser": self.reasoning_parser, "tools": self.tools, "ok": not self.failed,
                "checks": [asdict(c) for c in self.checks], "notes": list(self.notes)}


# --- the checks ------------------------------------------------------------------------------------------------

def _at(finding: Finding, where: str) -> Finding:
    return replace(finding, where=where)


def check_append_only(template: Template) -> tuple[Check, list[str]]:
    findings: list[Finding] = []
    notes: list[str] = []
    compared = 0
    for name, messages, tools in CONVERSATIONS:
        turns = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
        for n, i in enumerate(turns):
            where = f"{name}, assistant message {i}"
            later = messages[:turns[n + 1]] if n + 1 < len(turns) else messages + [NEXT_USER]
            try:
                prompt, reply, close = template.latest_turn(messages[:i + 1], tools)
                found = template.divergence(prompt, reply, close, template.render(later, tools, True))
            except Divergence as exc:
                found = exc.finding
            except RenderError as exc:
                notes.append(f"append-only: skipped {name!r}: {exc}")
                break
            compared += 1
            if found:
                findings.append(_at(found, where))
                break  # the first difference per conversation; later ones follow from it
    if findings:
        return Check("append-only", FAIL, f"the template rewrites history in {len(findings)} of "
                     f"{len(CONVERSATIONS)} conversations: a later call's prompt does not start with an earlier "
                     "call's prompt + reply", tuple(findings),
                     "Plain chat calls after that point cannot merge with the earlier ones (each starts a new "
                     f"timeline). {TOKEN_EXACT} Or serve with a template that only appends (vLLM --chat-template "
                     "FILE) and check it with `harness doctor --chat-template FILE`."), notes
    if not compared:
        return Check("append-only", WARN, "no conversation could be rendered (see notes)", (),
                     "Check that the template renders system, user, assistant and tool messages."), notes
    return Check("append-only", OK, f"each call's prompt + reply is a prefix of the next call's prompt, as text and "
                 f"as token ids ({compared} turns over {len(CONVERSATIONS)} conversations)"), notes


def _echo(parser: Reader, reply: str) -> dict:
    """The assistant message an agent sends back after receiving `reply` parsed, as vLLM hands it on."""
    parsed = parser.parse(reply)
    calls = [(c["function"]["name"], _loads(c["function"]["arguments"])) for c in parsed.tool_calls]
    return assistant(parsed.content, *calls)


def _loads(arguments: str):
    value = json.loads(arguments)
    return value if isinstance(value, dict) else {}  # vLLM coerces non-objects to {} before templating


def _history_probes() -> list[tuple[str, dict, str | None]]:
    """(probe, the assistant message, the raw reply the model wrote; None: as the template renders the message)."""
    call = ("get_weather", {"city": "Paris", "days": 2})
    newlines = "\nIt is 21 °C in Paris.\n"
    think = "<think>\nLook it up.\n</think>\n\nIt is 21 °C."
    return [
        ("a tool call, echoed back", assistant(None, call), None),
        ("text before a tool call, echoed back", assistant("Let me check.", call), None),
        ("arguments written compactly, echoed back", assistant(None, call), "compact"),
        ("a reply with surrounding newlines", assistant(newlines), newlines),
        ("a reply with a <think> block", assistant(think), think),
    ]


def check_history(template: Template, parser: Reader, reasoned: bool = False) -> tuple[Check, list[str]]:
    """`reasoned`: a reasoning parser splits the model's thinking out of the content, so a reply never comes back
    with a <think> block in its content (the reasoning check covers where the template puts it)."""
    base = [SYSTEM, user("What's the weather in Paris?")]
    findings: list[Finding] = []
    notes: list[str] = []
    probes = 0
    for probe, message, raw in _history_probes():
        if reasoned and "<think>" in (raw or ""):
            continue
        try:
            prompt, reply, close = template.latest_turn(base + [message], TOOLS)
            if raw == "compact":  # the model wrote {"city":"Paris"} where the template writes {"city": "Paris"}
                args = message["tool_calls"][0]["function"]["arguments"]
                spaced, compact = json.dumps(args, ensure_ascii=False), json.dumps(args, separators=(",", ":"))
                if spaced not in reply:
                    notes.append(f"history: skipped {probe!r}: the template does not write arguments as JSON")
                    continue
                reply = reply.replace(spaced, compact)
            elif raw is not None:
                reply = raw  # exactly what the model wrote, whatever the template makes of it
            echoed = _echo(parser, reply) if message.get("tool_calls") else {**message, "content": reply}
            longer = template.render(base + [echoed, NEXT_USER], TOOLS, True)
            found = template.divergence(prompt, reply, close, longer)
        except Divergence as exc:
            found = exc.finding
        except RenderError as exc:
            notes.append(f"history: skipped {probe!r}: {exc}")
            continue
        probes += 1
        if found and message.get("tool_calls") and echoed["content"]:
            found = replace(found, what=f"{found.what} (the parser gave the agent content {show(echoed['content'])})")
        if found:
            findings.append(_at(found, probe))
    if findings:
        return Check("history", WARN, f"{len(findings)} of {probes} kinds of reply come back re-rendered "
                     "differently from what the model wrote, once the agent sends them back", tuple(findings),
                     "In plain chat mode the merger starts a new timeline after such a reply (reason: "
                     f"retokenization drift), if the model writes replies like these. {TOKEN_EXACT}"), notes
    if not probes:
        return Check("history", WARN, "no kind of reply could be rendered (see notes)"), notes
    return Check("history", OK, f"all {probes} kinds of reply come back exactly as the model wrote them"), notes


def check_tool_parser(template: Template, parser: Reader, reasoned: Reader | None = None,
                      others: Callable[[list[ToolTurn]], list[str]] | None = None, tools: bool = True) -> Check:
    """`reasoned`: the tool parser with the reasoning parser, as the engine reads a reply; it reads the turns the
    template renders with a reasoning block (GLM's `<think></think>` in every turn), the tool parser alone the others
    (a reasoning parser takes a turn without one for unfinished reasoning). `others(turns)`: the other tool parsers
    that read every turn, named when this one does not. `tools`: whether the user's agents use tools; when not, a
    template with no tool-call format at all is a warn (the model still drives agents without tools), not a FAIL."""
    try:
        turns = tool_turns(template)
    except (Divergence, RenderError) as exc:
        return Check("tool-parser", WARN, f"could not render an assistant turn to parse ({exc})")
    calling = [t for t in turns if t.message.get("tool_calls")]
    written = [word for t in calling for c in t.message["tool_calls"]  # what any tool-call format writes down
               for word in (c["function"]["name"], *c["function"]["arguments"]) if word in t.text]
    if calling and not written:
        return _no_tool_format(calling, tools)
    read = [read_turn(turn, parser, reasoned) for turn in turns]
    misread = [f for verdict, f in read if verdict == "misread"]
    limits = [f for verdict, f in read if verdict == "limit"]
    if misread:
        fits = others(turns) if others is not None else []
        which = (f"The tool parsers that read back every turn this template writes: {', '.join(fits)}; pass one with "
                 "--tool-parser (vLLM's --tool-call-parser)." if fits else
                 "No tool parser of vLLM's reads back every turn this template writes: check the template "
                 "(--chat-template FILE) against the model family's published format.")
        return Check("tool-parser", FAIL, f"the template writes {len(misread)} of {len(turns)} assistant turns in a "
                     f"way the {parser.name} parser does not read back", tuple(misread + limits),
                     f"Agents would get wrong tool calls or content from what the model writes. {which}")
    if limits:
        return Check("tool-parser", OK, f"the {parser.name} parser reads back the tool calls of all {len(turns)} "
                     f"assistant turns the template renders; {len(limits)} of them has text before its calls, which "
                     "this format has no place for (its calls open a reply): the parser reads it as the engine does",
                     tuple(limits))
    return Check("tool-parser", OK, f"the {parser.name} parser reads back the names, arguments and content of all "
                 f"{len(turns)} assistant turns the template renders (one and two tool calls, text before calls)")


def _no_tool_format(calling: list[ToolTurn], tools: bool) -> Check:
    """The template drops tool calls (SmolLM2's): the model can serve agents without tools only. A FAIL when the
    user asked for tools (--tools, or a --tool-parser named), else a warn that says what the model is good for."""
    findings = tuple(Finding(t.where, f"the template renders this turn as {show(t.text)}") for t in calling)
    serve = ("a template that writes tool calls in the format its parser reads (vLLM --chat-template FILE; check it "
             "with `harness doctor --chat-template FILE`), or use a model with tool support.")
    if tools:
        return Check("tool-parser", FAIL, "the template writes no tool calls at all: it has no tool-call format, so "
                     "no parser can read one back", findings,
                     f"Agents that use tools cannot work with this template. Serve the model with {serve}")
    return Check("tool-parser", WARN, "the template has no tool-call format (it writes no tool calls): use this model "
                 "for agents without tools; the other checks hold for those", findings,
                 "The template drops tool calls from the history (the turns above), so agents that use tools cannot "
                 f"work with it: for those, serve the model with {serve} `harness doctor --tools` makes this a FAIL.")


def other_readers(template: Template, model_dir: str | Path, tried: str, reasoning_parser: str | None):
    """`others` for check_tool_parser: every tool parser of vLLM's that loads with this tokenizer and reads every
    turn (a format limit allowed), as the engine would read them."""
    def reads_all(name: str, turns: list[ToolTurn]) -> bool:
        try:
            parser = Reader(reply_parsing(name, None, str(model_dir)), template.tokenizer)
            reasoned = (Reader(reply_parsing(name, reasoning_parser, str(model_dir)), template.tokenizer)
                        if reasoning_parser is not None else None)
            return all(read_turn(turn, parser, reasoned)[0] != "misread" for turn in turns)
        except Exception:  # a parser that does not load with this tokenizer, or fails on this format
            return False

    def readers(turns: list[ToolTurn]) -> list[str]:
        from proxy.parsing.native import TOOL_PARSERS

        other_ids = None  # the turns as agents send them back to a parser of the other kind of call ids

        def turns_for(name: str) -> list[ToolTurn]:
            nonlocal other_ids
            if (name in NAMED_ID_PARSERS) == template.named_ids:
                return turns
            if other_ids is None:
                other = Template(template.tokenizer, template.stop_ids, not template.named_ids)
                other.close = template.close
                other_ids = tool_turns(other)
            return other_ids

        return [name for name in TOOL_PARSERS if name != tried and reads_all(name, turns_for(name))]

    return readers


_THOUGHT, _LATER_THOUGHT = "I should look up Paris first.", "The tool says 21 degrees."


def check_reasoning(template: Template, reasoning_parser: str | None) -> Check:
    """Where the template renders a reply's reasoning, and which `reasoning_history` choice that makes fit."""
    call = assistant(None, ("get_weather", {"city": "Paris"}))
    loop = [SYSTEM, user("What's the weather in Paris?"), {**call, "reasoning_content": _THOUGHT},
            tool_result("call_0", '{"temp_c": 21}')]
    later = [*loop, {**assistant("It is 21 °C."), "reasoning_content": _LATER_THOUGHT}, NEXT_USER]
    try:
        latest = _THOUGHT in template.render(loop[:3], TOOLS, False)
        in_loop = _THOUGHT in template.render(loop, TOOLS, True)
        after_user = _THOUGHT in template.render(later, TOOLS, True) or _LATER_THOUGHT in template.render(
            later, TOOLS, True)
    except RenderError as exc:
        return Check("reasoning", WARN, f"could not render a reply with reasoning_content: {exc}")
    named = f"the {reasoning_parser} reasoning parser" if reasoning_parser else "a reasoning parser (none given)"
    pick = ("Use reasoning_history as_rendered (the default): each call after a reply that reasoned starts a new "
            "sample, trained on the history as the model is served it; keep would merge the episode into one sample "
            "with the sampled reasoning in a context the model is never served.")
    if not latest and not in_loop:
        if reasoning_parser is None:
            return Check("reasoning", OK, "the template does not render a reply's reasoning (reasoning_content) at all")
        return Check("reasoning", WARN, f"the template does not render a reply's reasoning at all: with {named}, "
                     "every call after a reply that reasoned sees none of it; reasoning_history as_rendered fits", (),
                     pick)
    if in_loop and not after_user:
        return Check("reasoning", OK, "the template renders a reply's reasoning while its tool loop lasts and drops it "
                     "at the next user message (as Qwen3 does): reasoning_history as_rendered (the default) fits, "
                     "one sample per user turn with the calls of each tool loop merged; keep gives one sample per "
                     "episode, trained with earlier reasoning the model is not served with")
    if in_loop and after_user:
        return Check("reasoning", OK, "the template keeps every reply's reasoning in the history: both "
                     "reasoning_history choices merge the whole episode into one sample; keep the default, "
                     "as_rendered")
    return Check("reasoning", WARN, "the template renders reasoning for the latest reply only and drops it as soon as "
                 "another message follows: reasoning_history as_rendered fits", (), pick)


def check_close_token(template: Template) -> Check:
    """Also sets `template.close`: the close token's text ("" when there is none), for the other checks."""
    reply = "The answer is 4."
    messages = [SYSTEM, user("What is 2 + 2?"), assistant(reply)]
    try:
        turn = template.render(messages, None, False)
        longer = template.render(messages + [NEXT_USER], None, True)
    except RenderError as exc:
        return Check("close-token", FAIL, f"cannot render a one-turn conversation: {exc}")
    # The text after the reply in the next call's prompt: where a sampled reply must have stopped.
    after = longer[longer.rfind(reply) + len(reply):] if reply in longer else ""
    ids = template.ids(after)
    if not ids or ids[0] not in template.stop_ids:
        stops = ", ".join(f"{show(template.tokenizer.decode([i]))} (id {i}, {src})"
                          for i, src in template.stop_ids.items())
        return Check("close-token", FAIL, f"after an assistant reply the next prompt goes on with "
                     f"{show(after[:CONTEXT_CHARS])}, which does not start with a stop token; the model stops on: "
                     f"{stops or 'nothing (no eos)'}", (),
                     "A sampled reply ends at a stop token, so it never ends where the template's turn ends: the "
                     "merger cannot line replies up with history. Set eos_token_id in generation_config.json to "
                     "the template's end-of-turn token (or fix the template).")
    template.close = template.tokenizer.decode(ids[:1])
    tail = turn[turn.rfind(reply) + len(reply):] if reply in turn else ""
    glue = (f"then writes {show(tail[len(template.close):])}, which is context (mask 0), never trained"
            if tail.startswith(template.close) else "writes it only once another message follows")
    return Check("close-token", OK, f"an assistant turn ends with {show(template.close)} (id {ids[0]}, "
                 f"{template.stop_ids[ids[0]]}), where sampling stops; the template {glue}")


# --- entry points ----------------------------------------------------------------------------------------------

@contextmanager
def _quiet_vllm():
    """vLLM's parsers log every reply they cannot read, with a traceback: doctor reports those as findings."""
    vllm_log = logging.getLogger("vllm")
    level = vllm_log.level
    vllm_log.setLevel(logging.CRITICAL + 1)
    try:
        yield
    finally:
        vllm_log.setLevel(level)


def diagnose(model_dir: str | Path, tool_parser: str = "hermes", chat_template: str | Path | None = None,
             reasoning_parser: str | None = None, tools: bool = True,
             say: Callable[[str], None] | None = None) -> Report:
    """Run the five checks on the model in `model_dir`; raises DoctorError on bad input. `tools`: whether the agents
    use tools (False: a template without any tool-call format is a warn, see check_tool_parser). `say(line)` is told
    once the input looks right, before the slow part (importing transformers and vLLM's parsers)."""
    check_input(Path(model_dir), chat_template, tool_parser, reasoning_parser)
    if say is not None:
        say("doctor: loading the tokenizer and vLLM's parsers, then rendering the checks' conversations ...")
    with _quiet_vllm():
        return _diagnose(model_dir, tool_parser, chat_template, reasoning_parser, tools)


def _diagnose(model_dir: str | Path, tool_parser: str, chat_template: str | Path | None,
              reasoning_parser: str | None, tools: bool) -> Report:
    tokenizer = load_tokenizer(model_dir, chat_template)
    try:  # tool calls are read by the tool parser alone (the reasoning check places the reasoning), but for turns
        # the template renders with a reasoning block (check_tool_parser)
        check_reasoning_parser(reasoning_parser)
        parser = Reader(reply_parsing(tool_parser, None, str(model_dir)), tokenizer)
        reasoned = (Reader(reply_parsing(tool_parser, reasoning_parser, str(model_dir)), tokenizer)
                    if reasoning_parser is not None else None)
    except (ValueError, TypeError) as exc:  # a bad name; a parser that cannot work with this tokenizer (vLLM's)
        raise DoctorError(str(exc)) from exc
    template = Template(tokenizer, stop_ids(tokenizer, Path(model_dir)), tool_parser in NAMED_ID_PARSERS)
    close_check = check_close_token(template)
    append_only, notes = check_append_only(template)
    history, history_notes = check_history(template, parser, reasoned=reasoning_parser is not None)
    others = other_readers(template, model_dir, tool_parser, reasoning_parser)
    checks = (append_only, history, check_tool_parser(template, parser, reasoned, others, tools),
              check_reasoning(template, reasoning_parser), close_check)
    source = str(chat_template) if chat_template is not None else "the model's own"
    return Report(str(model_dir), source, parser.name, checks, reasoning_parser=reasoning_parser,
                  notes=tuple(notes + history_notes), tools=tools)


def format_report(report: Report) -> str:
    """One line per check, then the findings and advice of those that are not ok."""
    reasoning = f"; reasoning parser: {report.reasoning_parser}" if report.reasoning_parser else ""
    lines = [f"harness doctor: {report.model} (template: {report.template}; tool parser: {report.tool_parser}"
             f"{reasoning})"]
    for check in report.checks:
        lines.append(f"{check.status:<5} {check.name:<12} {check.summary}")
        for f in check.findings:
            at = f", at {'char' if f.level == 'text' else 'token'} {f.position}" if f.position is not None else ""
            lines.append(f"      - {f.where}{at}: {f.what}")
            for label, value in (("after", f.before), ("expected", f.expected), ("found", f.found)):
                if value is not None:
                    shown = show(value) if f.level == "text" else value
                    lines.append(f"          {label + ':':<10}{'…' if label == 'after' else ''}{shown}")
        if check.advice:
            lines.append(textwrap.fill(check.advice, width=116, initial_indent=" " * 6, subsequent_indent=" " * 6))
    lines.extend(f"note: {note}" for note in report.notes)
    return "\n".join(lines)
