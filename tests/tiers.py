"""The rule that makes the engine tier, as a pytest plugin (tests/conftest.py loads it): the tests in files named
`*_engine.py` need a real vLLM (the `engine` fixture, or engines they start themselves) and get the `engine` mark;
a test anywhere else that marks itself `engine` or asks for the engine is refused, naming it. `make test-fast` runs
`-m "not engine"`, `make test-engine` runs `-m engine`.

`--first PREFIX` (any number) runs the tests whose ids start with a PREFIX first, in their order: `make test` starts
the fast tier with its trainer tests (processes that compute on both cores) while the engine tier's first files
mostly wait on the engine, so the two tiers' trainer runs do not meet at the end (CI time).

`--to-engine-tier PREFIX` (any number; `make test` gives both tiers the same) moves the tests whose ids start with a
PREFIX from the fast tier to the end of the engine tier: they need no engine, but the engine tier ends minutes before
the fast tier (measured: 31 vs 38 min), so its last minutes take some of the fast tier's work."""

from __future__ import annotations

import pytest

ENGINE_TIER = "_engine.py"  # the file names of the engine tier


def pytest_addoption(parser):
    parser.addoption("--first", action="append", default=[], metavar="PREFIX",
                     help="run the tests whose ids start with PREFIX first (e.g. tests/trainer/); may be repeated")
    parser.addoption("--to-engine-tier", action="append", default=[], metavar="PREFIX",
                     help="count the tests whose ids start with PREFIX in the engine tier, at its end; may be repeated")


@pytest.hookimpl(tryfirst=True)  # before `-m` selects by marks
def pytest_collection_modifyitems(config, items):
    misplaced = []
    for item in items:
        if item.path.name.endswith(ENGINE_TIER):
            item.add_marker(pytest.mark.engine)
        elif item.get_closest_marker("engine") or "engine" in getattr(item, "fixturenames", ()):
            misplaced.append(item.nodeid)
    moved = tuple(config.getoption("to_engine_tier"))
    if moved:
        for item in items:
            if item.nodeid.startswith(moved) and not item.get_closest_marker("engine"):
                item.add_marker(pytest.mark.engine)
        items.sort(key=lambda item: item.nodeid.startswith(moved))  # stable: at the end, each keeps its order
    first = config.getoption("first")
    if first:
        items.sort(key=lambda item: next((k for k, prefix in enumerate(first) if item.nodeid.startswith(prefix)),
                                         len(first)))  # stable: each group keeps its order
    if misplaced:
        raise pytest.UsageError("tests that need the engine live in files named *_engine.py (the engine tier); move "
                                "these there: " + ", ".join(misplaced))
