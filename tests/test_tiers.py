"""The engine tier's rule (tests/tiers.py), run on files made for the purpose in a pytest of their own."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FIXTURE = """
import pytest

@pytest.fixture
def engine():
    return "an engine"
"""


@pytest.fixture(autouse=True)
def _our_plugins_importable(monkeypatch):
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))


def _run(pytester: pytest.Pytester, *args: str) -> pytest.RunResult:
    pytester.makeconftest(FIXTURE)
    return pytester.runpytest_subprocess("-p", "tests.tiers", "-q", *args)


def test_files_named_engine_are_the_engine_tier(pytester: pytest.Pytester):
    pytester.makepyfile(test_fast="def test_a():\n    pass\n",
                        test_thing_engine="def test_b(engine):\n    assert engine\n")
    _run(pytester, "-m", "engine").assert_outcomes(passed=1, deselected=1)
    _run(pytester, "-m", "not engine").assert_outcomes(passed=1, deselected=1)


@pytest.mark.parametrize("body", ["def test_b(engine):\n    pass\n",
                                  "import pytest\n\n@pytest.mark.engine\ndef test_b():\n    pass\n"])
def test_an_engine_test_elsewhere_is_refused_by_name(pytester: pytest.Pytester, body: str):
    pytester.makepyfile(test_misplaced=body)
    result = _run(pytester, "-m", "not engine")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*files named *_engine.py*test_misplaced.py::test_b*"])
