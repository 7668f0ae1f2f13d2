"""A coding task done by a coding agent as it ships (Codex CLI, Claude Code, opencode, Qwen Code, mini-swe-agent or
aider), unmodified, for `harness run`.

The task comes in HARNESS_TASK (else on stdin), in one of two forms:
- `{"id", "prompt", "files": {path: text}, "check": "a shell command", "answer": "pass"}`: this wrapper makes a
  scratch git repository holding the task's files, runs the CLI there on the prompt, then runs the task's check in
  the repository and prints `{"answer": "pass"}` or `{"answer": "fail"}` last, for the judge (exact_match against
  the task's answer). The repository is removed afterwards (HARNESS_KEEP_SCRATCH=1 keeps it).
- a Harbor task (`{"task_id", "prompt"}`, no check): the CLI runs in the current directory, the sandbox's workspace
  (docs/sandboxes.md), and the task's own tests judge what it leaves there; the answer printed is the CLI's exit.
Either way the CLI is pointed at the proxy by its own settings (made from the OPENAI_BASE_URL and OPENAI_API_KEY
that `harness run` gives each episode), and its output goes to stderr, with the check's.

    harness run examples/coding_agents/coding_agent.py --data examples/coding_agents/tasks.jsonl \\
        --judge exact_match --model runs/tiny                    # Codex CLI (the default)
    harness run --cmd "python examples/coding_agents/coding_agent.py claude" --data ... # Claude Code
    harness run examples/coding_agents/coding_agent.py --data examples/harbor_tasks \
        --sandbox-bind examples/coding_agents/node_modules --model runs/tiny   # Harbor tasks, sandboxed

The CLIs come from examples/coding_agents/node_modules (`make install`), mini-swe-agent's `mini` from the
checkout's .venv-agents and aider from its .venv-aider (`make install`), else from PATH. No harness imports: an
agent is any program.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
# The PyPI agents' installs (make install): mini-swe-agent beside the other Python agents; aider, whose exact pins
# no other package shares, in a venv of its own.
VENVS = {"mini": HERE.parents[1] / ".venv-agents", "aider": HERE.parents[1] / ".venv-aider"}
CODEX_MODEL = "gpt-5-codex"  # any name: the proxy serves its policy under it (Claude Code keeps its default model)
CHECK_TIMEOUT_S = 60


def read_task() -> dict:
    text = os.environ.get("HARNESS_TASK") or sys.stdin.read()
    task = json.loads(text)
    for key in ("prompt", "check") if "check" in task or "task_id" not in task else ("prompt",):
        if not isinstance(task.get(key), str) or not task[key]:
            raise SystemExit(f"coding_agent: the task has no {key!r} string: {text[:200]}")
    return task


def cli(name: str) -> str:
    local = (VENVS[name] / "bin" if name in VENVS else HERE / "node_modules" / ".bin") / name
    found = str(local) if local.exists() else shutil.which(name)
    if found is None:
        raise SystemExit(f"coding_agent: no {name} here: run `make install` (npm ci in {HERE}) or put it on PATH")
    return found


def scratch_repo(files: dict[str, str]) -> Path:
    """A git repository with the task's files committed: what a coding agent expects to work in."""
    repo = Path(tempfile.mkdtemp(prefix="harness-task-"))
    for name, text in files.items():
        path = (repo / name).resolve()
        if repo.resolve() not in path.parents:
            raise SystemExit(f"coding_agent: the task's file {name!r} is outside its repository")
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    git = ["git", "-c", "user.name=harness", "-c", "user.email=harness@localhost", "-c", "init.defaultBranch=main"]
    for args in (["init", "-q"], ["add", "-A"], ["commit", "-q", "--allow-empty", "-m", "the task"]):
        subprocess.run([*git, *args], cwd=repo, check=True, stdout=sys.stderr)
    return repo


def codex_config(base_url: str, key_env: str = "OPENAI_API_KEY") -> str:
    """Codex's config.toml for a provider at `base_url` (the proxy), its api key in the variable `key_env`: what a
    user writes into ~/.codex/config.toml (Codex 0.171 reads no OPENAI_BASE_URL)."""
    return f'''model = "{CODEX_MODEL}"
model_provider = "harness"
check_for_update_on_startup = false

[model_providers.harness]
name = "harness proxy"
base_url = "{base_url}"
env_key = "{key_env}"
wire_api = "responses"

[analytics]
enabled = false

[feedback]
enabled = false
'''


def codex(prompt: str, repo: Path, home: Path, base_url: str, api_key: str) -> list[str]:
    """`codex exec` with a provider at the proxy, its settings in a CODEX_HOME of its own."""
    (home / "config.toml").write_text(codex_config(base_url))
    os.environ.update({"CODEX_HOME": str(home), "OPENAI_API_KEY": api_key})
    return [cli("codex"), "exec", "--skip-git-repo-check", "--dangerously-bypass-approvals-and-sandbox",
            "--disable", "plugins", prompt]


def claude(prompt: str, repo: Path, home: Path, base_url: str, api_key: str) -> list[str]:
    """`claude -p` at the proxy's Anthropic Messages route (its base URL has no /v1: Claude Code adds it)."""
    os.environ.update({"HOME": str(home), "ANTHROPIC_BASE_URL": base_url.removesuffix("/").removesuffix("/v1"),
                       "ANTHROPIC_API_KEY": api_key,
                       "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1", "DISABLE_AUTOUPDATER": "1"})
    if os.geteuid() == 0:  # as root, Claude Code skips its permission prompts only inside a sandbox it is told of
        os.environ["IS_SANDBOX"] = "1"
    return [cli("claude"), "-p", prompt, "--dangerously-skip-permissions"]


def opencode(prompt: str, repo: Path, home: Path, base_url: str, api_key: str) -> list[str]:
    """`opencode run` with a provider of its own at the proxy (the AI SDK's OpenAI-compatible one, which opencode
    bundles), offline: no models.dev list, no update check, no plugins; the session's title given (so no title
    call) and its permissions approved (--auto)."""
    config = {"$schema": "https://opencode.ai/config.json", "model": "harness/policy", "autoupdate": False,
              "share": "disabled",
              "provider": {"harness": {"npm": "@ai-sdk/openai-compatible", "name": "harness proxy",
                                       "options": {"baseURL": base_url, "apiKey": "{env:OPENAI_API_KEY}"},
                                       "models": {"policy": {"name": "policy"}}}}}
    (home / "opencode.json").write_text(json.dumps(config, indent=2))
    os.environ.update({"HOME": str(home), "OPENCODE_CONFIG": str(home / "opencode.json"), "OPENAI_API_KEY": api_key,
                       **dict.fromkeys(("OPENCODE_DISABLE_MODELS_FETCH", "OPENCODE_DISABLE_AUTOUPDATE",
                                        "OPENCODE_DISABLE_DEFAULT_PLUGINS", "OPENCODE_DISABLE_LSP_DOWNLOAD",
                                        "OPENCODE_DISABLE_SHARE"), "1")})
    return [cli("opencode"), "run", "--pure", "--auto", "--title", "harness episode", prompt]


def qwen(prompt: str, repo: Path, home: Path, base_url: str, api_key: str) -> list[str]:
    """`qwen -p` on its OpenAI provider (OPENAI_BASE_URL, OPENAI_API_KEY, OPENAI_MODEL), tools approved (--yolo),
    without its memory sub-agent (a second call after every task), usage statistics or update checks; without its
    `agent` and `skill` tools and bundled skills, whose descriptions alone are 26k characters of each prompt (~12k
    tokens: with them the first prompt is past a 32k context)."""
    settings = {"security": {"auth": {"selectedType": "openai"}}, "general": {"enableAutoUpdate": False},
                "privacy": {"usageStatisticsEnabled": False}, "telemetry": {"enabled": False},
                "memory": {"enableManagedAutoMemory": False, "enableManagedAutoDream": False,
                           "enableAutoSkill": False},
                "permissions": {"deny": ["agent", "skill"]}, "skills": {"disabledLevels": ["bundled"]}}
    (home / ".qwen").mkdir()
    (home / ".qwen" / "settings.json").write_text(json.dumps(settings, indent=2))
    os.environ.update({"HOME": str(home), "OPENAI_BASE_URL": base_url, "OPENAI_API_KEY": api_key,
                       "OPENAI_MODEL": "qwen3-coder-plus", "QWEN_CODE_SUPPRESS_YOLO_WARNING": "1"})
    return [cli("qwen"), "-p", prompt, "--yolo"]


def mini(prompt: str, repo: Path, home: Path, base_url: str, api_key: str) -> list[str]:
    """mini-swe-agent's `mini` through litellm's OpenAI provider at the proxy, without confirmations, cost tracking
    (the model is no priced one) or a cost limit. Its default config offers a bash tool; MINI_CONFIG=textbased
    picks its mini_textbased.yaml instead, whose actions are ```mswea_bash_command blocks in the reply's text (for a
    model that has no tool calls), and MINI_ACTION_REGEX replaces the regex that finds that block. MINI_STEP_LIMIT:
    its calls per task (default 20)."""
    os.environ.update({"HOME": str(home), "MSWEA_CONFIGURED": "true",  # no first-run setup questions
                       "MSWEA_COST_TRACKING": "ignore_errors", "MSWEA_SILENT_STARTUP": "1",
                       "LITELLM_LOCAL_MODEL_COST_MAP": "True",  # litellm's price list from the package, offline
                       "OPENAI_API_KEY": api_key})
    which = os.environ.get("MINI_CONFIG", "default")
    if which not in ("default", "textbased"):
        raise SystemExit(f"coding_agent: MINI_CONFIG={which!r}: expected default or textbased")
    config = ["-c", "mini_textbased.yaml", "-c", "model.model_class=litellm_textbased"] if which == "textbased" \
        else ["-c", "mini.yaml"]
    if os.environ.get("MINI_ACTION_REGEX"):
        if which != "textbased":
            raise SystemExit("coding_agent: MINI_ACTION_REGEX is for MINI_CONFIG=textbased (the default config's "
                             "actions are tool calls)")
        config += ["-c", f"model.action_regex={os.environ['MINI_ACTION_REGEX']}"]
    steps = os.environ.get("MINI_STEP_LIMIT", "20")
    if not steps.isdigit():
        raise SystemExit(f"coding_agent: MINI_STEP_LIMIT={steps!r}: expected a whole number of calls")
    return [cli("mini"), "--model", "openai/gpt-4o-mini", "--task", prompt, "--yolo", "--exit-immediately",
            "--cost-limit", "0", *config, "-c", f"model.model_kwargs.api_base={base_url}",
            "-c", f"agent.step_limit={steps}", "-o", str(home / "trajectory.json")]


def aider(prompt: str, repo: Path, home: Path, base_url: str, api_key: str) -> list[str]:
    """`aider --message` (one request, its edits applied: the whole-file edit format, which small models write best)
    through litellm's OpenAI provider at the proxy, confirmations answered yes, without git, update checks,
    analytics or litellm's price list from the network; its histories in its home, not the workspace."""
    os.environ.update({"HOME": str(home), "LITELLM_LOCAL_MODEL_COST_MAP": "True", "OPENAI_API_KEY": api_key})
    return [cli("aider"), "--model", "openai/gpt-4o-mini", "--openai-api-base", base_url, "--edit-format", "whole",
            "--yes-always", "--no-git", "--no-check-update", "--no-show-model-warnings", "--no-show-release-notes",
            "--analytics-disable", "--no-pretty", "--no-fancy-input", "--chat-history-file", str(home / "chat.md"),
            "--input-history-file", str(home / "input.history"), "--message", prompt]


AGENTS = {"codex": codex, "claude": claude, "opencode": opencode, "qwen": qwen, "mini": mini, "aider": aider}


def main() -> int:
    which = sys.argv[1] if len(sys.argv) > 1 else "codex"
    if which not in AGENTS:
        raise SystemExit(f"coding_agent: unknown agent {which!r}: one of {', '.join(AGENTS)}")
    task = read_task()
    base_url, api_key = os.environ.get("OPENAI_BASE_URL"), os.environ.get("OPENAI_API_KEY", "none")
    if not base_url:
        raise SystemExit("coding_agent: OPENAI_BASE_URL is not set: run me under harness run (or set it to the proxy)")
    harbor = "check" not in task  # a Harbor task: the workspace is here, and its tests judge it
    repo = Path.cwd() if harbor else scratch_repo(task.get("files") or {})
    home = Path(tempfile.mkdtemp(prefix="harness-home-"))
    try:
        command = AGENTS[which](task["prompt"], repo, home, base_url, api_key)
        ran = subprocess.run(command, cwd=repo, stdin=subprocess.DEVNULL, stdout=sys.stderr, stderr=sys.stderr)
        print(f"coding_agent: {which} exited {ran.returncode}", file=sys.stderr)
        if harbor:
            print(json.dumps({"answer": f"{which} exited {ran.returncode}"}))
            return 0
        check = subprocess.run(task["check"], shell=True, cwd=repo, capture_output=True, text=True,
                               timeout=CHECK_TIMEOUT_S)
        print(f"coding_agent: check {task['check']!r} exited {check.returncode}\n{check.stdout}{check.stderr}",
              file=sys.stderr)
        print(json.dumps({"answer": "pass" if check.returncode == 0 else "fail"}))
        return 0
    finally:
        if os.environ.get("HARNESS_KEEP_SCRATCH") != "1" and not harbor:
            shutil.rmtree(repo, ignore_errors=True)
        shutil.rmtree(home, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
