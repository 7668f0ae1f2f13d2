"""Docs that run: every `harness ...` command line in README.md, docs/*.md and the examples' READMEs parses on the
real command line (every flag exists; in code blocks, required arguments are there too), and every config key the
docs and examples name (`trainer.lr`, `--set rollout.engine.sleep=1`, the keys of a YAML config block) is a key
of the config schema. The checker is run on planted mistakes too, so it can fail. Every example training config
passes `harness train CONFIG --check`."""

from __future__ import annotations

import contextlib
import difflib
import importlib.util
import io
import re
import shlex
from pathlib import Path

import pytest
import yaml

from harness.cli.main import build_parser, main
from trainer.config.reference import iter_keys

ROOT = Path(__file__).resolve().parents[1]
DOCS = sorted([ROOT / "README.md", *(ROOT / "docs").glob("*.md"),  # ours: not the READMEs npm installed
               *(p for p in (ROOT / "examples").glob("**/README.md") if "node_modules" not in p.parts)])
KEYS = {name for name, *_ in iter_keys()}
SECTIONS = {name for name in KEYS if "." not in name}
HARNESS = re.compile(r"^(?:\S*/)?harness$")  # harness, .venv/bin/harness
FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.M | re.S)
INLINE = re.compile(r"(?<!`)`([^`\n]+)`(?!`)")
DOTTED = re.compile(r"(?<![\w./-])([a-z_]+(?:\.[a-z_0-9]+)+)(?=[=\s`,;:)]|$)")
SHELLS = {"", "bash", "sh", "shell", "console"}  # ```text is output or a diagram
ELLIPSIS = {"...", "…"}
NOT_KEYS = {"weight", "bias", "safetensors", "json", "jsonl", "yaml", "yml", "py", "md", "duckdb", "parquet", "txt",
            "csv", "bin", "pt", "gguf", "png", "html", "tiktoken", "toml", "sh", "js", "log", "jinja"}  # files, tensors


def command_lines(text: str) -> list[tuple[str, bool]]:
    """(command line, whole) for every `harness` invocation: whole ones come from shell code blocks (checked with
    their required arguments), the rest from inline code (checked for their verb and flags)."""
    found = []
    for lang, body in FENCE.findall(text):
        if lang in SHELLS:
            for line in body.replace("\\\n", " ").splitlines():
                found += [(c, True) for c in _invocations(line.removeprefix("$ "))]
    prose = FENCE.sub("", text)
    for span in INLINE.findall(prose):
        found += [(c, False) for c in _invocations(span)]
    return found


def _invocations(line: str) -> list[str]:
    try:
        words = shlex.split(line, comments=True)
    except ValueError:
        return []
    out, current, other = [], None, False  # the harness command being read; inside another command
    for word in words + ["&&"]:
        if word in ("&&", "||", "|", ";", "&"):
            if current:
                out.append(shlex.join(current))
            current, other = None, False
        elif current is not None:
            current.append(word)
        elif not other and HARNESS.match(word):
            current = ["harness"]
        elif "=" not in word:  # not an environment assignment before a command: another command
            other = True
    return out


def parse_problem(command: str, whole: bool) -> str | None:
    """Why `command` does not parse on the harness command line (None: it does)."""
    argv = [w.strip("[]") for w in shlex.split(command)[1:] if w not in ELLIPSIS]  # a synopsis: [--flag VALUE]
    if not argv or argv[0] in ("-h", "--help", "--version"):
        return None
    parser = build_parser()
    verbs = next(a for a in parser._actions if a.dest == "verb").choices
    if argv[0] not in verbs:
        return f"no verb {argv[0]!r} (verbs: {', '.join(verbs)})"
    verb = verbs[argv[0]]
    if not whole:
        flags = {s for a in verb._actions for s in a.option_strings}
        unknown = [w.split("=")[0] for w in argv[1:] if w.startswith("--") and w.split("=")[0] not in flags]
        return f"{argv[0]} has no {', '.join(unknown)}" if unknown else None
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            args = parser.parse_args(argv)
        except SystemExit as exc:
            return (err.getvalue().strip().splitlines() or [f"exit {exc.code}"])[-1]
    problems = [_key_problem(o.split("=")[0]) for o in getattr(args, "overrides", None) or [] if "=" in o]
    return next((p for p in problems if p), None)


def key_names(text: str, foreign_first_column: bool = False) -> list[str]:
    """Dotted names in the text that start with a config section (`trainer.lr`, `rollout.engine.sleep`).
    foreign_first_column: the text names another tool's keys, in its prose and the first column of its tables
    (docs/MIGRATING.md); ours are in the other columns."""
    if foreign_first_column:  # only what its tables say of ours
        text = "\n".join(re.sub(r"^\|[^|]*\|", "|", line) for line in text.splitlines() if line.startswith("|"))
    names = []
    for span in INLINE.findall(FENCE.sub("", text)):  # in code blocks, harness's --set keys (parse_problem)
        names += [m for m in DOTTED.findall(span)
                  if m.split(".")[0] in SECTIONS and m.rsplit(".", 1)[1] not in NOT_KEYS]
    return names


def _key_problem(name: str) -> str | None:
    name = name.removeprefix("harness.")
    if name in KEYS or name.split(".")[0] not in SECTIONS or _is_python(name):
        return None
    near = difflib.get_close_matches(name, KEYS, n=1)
    return f"no config key {name!r}" + (f" (did you mean {near[0]!r}?)" if near else "")


def _is_python(dotted: str) -> bool:
    """A module or an attribute of one (trainer.lora, trainer.fsdp.shutdown): named as code, not as a key."""
    parts = dotted.split(".")
    for k in range(len(parts), 0, -1):
        try:
            found = importlib.util.find_spec(".".join(parts[:k])) is not None
        except (ImportError, ValueError):
            continue
        if found:
            thing = importlib.import_module(".".join(parts[:k]))
            for attr in parts[k:]:
                if not hasattr(thing, attr):
                    return False
                thing = getattr(thing, attr)
            return True
    return False


def yaml_key_problems(text: str) -> list[str]:
    """Keys of YAML blocks that are harness configs (a `harness:` root, or root keys that are all sections)."""
    problems = []
    for lang, body in FENCE.findall(text):
        if lang not in ("yaml", "yml"):
            continue
        try:
            tree = yaml.safe_load(body)
        except yaml.YAMLError:
            continue
        problems += config_key_problems(tree)
    return problems


def config_key_problems(tree) -> list[str]:
    if not isinstance(tree, dict):
        return []
    root = tree.get("harness") if isinstance(tree.get("harness"), dict) else tree
    if root is not tree or (root and set(root) <= KEYS and set(root) & SECTIONS):
        return [p for p in (_walk(root, "")) if p]
    return []


def _walk(mapping: dict, prefix: str) -> list[str | None]:
    out = []
    for key, value in mapping.items():
        name = f"{prefix}{key}"
        if name not in KEYS:
            out.append(_key_problem(name) or f"no config key {name!r}")
        elif isinstance(value, dict) and name in SECTIONS | {k for k in KEYS if _is_section(k)}:
            out += _walk(value, name + ".")
    return out


def _is_section(key: str) -> bool:
    return any(k.startswith(key + ".") for k in KEYS)


# ------------------------------------------------------------------------------------------------ the checks


def _rel(path: Path) -> str:
    return str(path.relative_to(ROOT))


@pytest.mark.parametrize("doc", DOCS, ids=_rel)
def test_every_harness_command_line_in_the_docs_parses(doc):
    text = doc.read_text(encoding="utf-8")
    problems = [f"{command!r}: {why}" for command, whole in command_lines(text)
                if (why := parse_problem(command, whole))]
    assert not problems, f"{_rel(doc)}:\n" + "\n".join(problems)


@pytest.mark.parametrize("doc", DOCS, ids=_rel)
def test_every_config_key_the_docs_name_exists(doc):
    text = doc.read_text(encoding="utf-8")
    names = key_names(text, foreign_first_column=doc.name == "MIGRATING.md")
    problems = [p for name in names if (p := _key_problem(name))] + yaml_key_problems(text)
    assert not problems, f"{_rel(doc)}:\n" + "\n".join(sorted(set(problems)))


@pytest.mark.parametrize("config", sorted((ROOT / "examples").glob("**/*.yaml")), ids=_rel)
def test_every_key_of_the_example_configs_exists(config):
    problems = config_key_problems(yaml.safe_load(config.read_text(encoding="utf-8")))
    assert not problems, f"{_rel(config)}:\n" + "\n".join(problems)


@pytest.mark.parametrize("config", sorted((ROOT / "examples" / "train").glob("*.yaml")), ids=_rel)
def test_every_example_train_config_passes_check(config, tiny_model_dir, capsys):
    """`harness train CONFIG --check` exits 0 on each example config: on the model it names when that is here (a
    directory built, e.g. runs/tiny), else on the tiny model in its place, as the configs' comments suggest."""
    from trainer.config import read_config

    model = read_config(config).model.path
    overrides = [] if model and Path(model).is_dir() else ["--set", f"model.path={tiny_model_dir}"]
    code = main(["train", str(config), "--check", *overrides])
    assert code == 0, capsys.readouterr().out


PLANTED = """
Run it:

```bash
OPENAI_API_KEY=x .venv/bin/harness run agent.py --data tasks.jsonl --model runs/tiny --no-such-flag
harness run agent.py --model runs/tiny   # --data left out
harness sql "SELECT 1" && harness view --db runs/harness.duckdb
harness train my.yaml --set trainer.no_such_key=1
```

Then `harness serve --also-not-a-flag`, and set `rollout.engine.not_a_key` or `trainer.lr`.

```yaml
harness:
  trainer:
    lr: 1.0e-5
    not_a_key: 3
```
"""


def test_the_checker_finds_planted_mistakes_and_passes_the_rest():
    found = {c: parse_problem(c, whole) for c, whole in command_lines(PLANTED)}
    assert len(found) == 6, found
    by_start = {c.split("--")[0].strip() + (" --no-such-flag" if "--no-such-flag" in c else ""): p
                for c, p in found.items()}
    assert "--no-such-flag" in by_start["harness run agent.py --no-such-flag"]
    assert "--data" in found["harness run agent.py --model runs/tiny"]
    assert found["harness sql 'SELECT 1'"] is None and found["harness view --db runs/harness.duckdb"] is None
    assert "trainer.no_such_key" in found["harness train my.yaml --set trainer.no_such_key=1"]
    assert "--also-not-a-flag" in found["harness serve --also-not-a-flag"]
    assert [p.split(" (")[0] for n in key_names(PLANTED) if (p := _key_problem(n))] == [
        "no config key 'rollout.engine.not_a_key'"]  # and `trainer.lr` is one
    assert [p.split(" (")[0] for p in yaml_key_problems(PLANTED)] == ["no config key 'trainer.not_a_key'"]


@pytest.mark.parametrize("doc", [d for d in DOCS if d.name != "BENCHMARKS.md"], ids=_rel)
def test_the_docs_cite_no_internal_issue_and_use_the_readmes_model_folders(doc):
    """Users cannot see the project's issue numbers (BENCHMARKS.md keeps its measurement history); model
    directories are where the README builds them (runs/tiny, runs/smollm2), not a models/ folder nothing makes."""
    text = doc.read_text(encoding="utf-8")
    assert not re.findall(r"\bissue \d+", text), _rel(doc)
    assert not re.findall(r"--model models/", text), _rel(doc)
