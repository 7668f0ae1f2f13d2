"""harness: record unmodified LLM agents through a proxy, judge them, and train the policy with RL.

The layers, lowest first; a module imports only its own layer and lower ones (tests/test_layers.py holds the line):

    harness.core      records, flags, the merger
    harness.store     schema, store, recorder, SQL, exports
    proxy             the recording proxy (its front door: proxy.server.ProxyServer)
    harness.running   the engine, agents as episodes, tasks, judges, reports;
    harness.sandbox   beside it: where a sandboxed episode runs (bubblewrap), behind one seam
    trainer           the RL loop and its parts, itself in rooms: maths, model, config, rl, offline
    adapters          what joins us to other software (verl)
    harness.cli       the `harness` command; harness.viewer, `harness view`
"""

__version__ = "0.1.0"


def install_hint(extra: str) -> str:
    """How a user gets one of our extras (pyproject.toml); the distribution is harness-rl, not PyPI's `harness`."""
    return f"pip install -e '.[{extra}]' in the harness checkout"
