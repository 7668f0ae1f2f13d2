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


def test_first_runs_the_tests_under_a_prefix_first_each_group_in_its_order(pytester: pytest.Pytester):
    pytester.makepyfile(test_a="def test_1():\n    pass\n\ndef test_2():\n    pass\n",
                        test_b="def test_3():\n    pass\n", test_c="def test_4():\n    pass\n")
    result = _run(pytester, "-vv", "--first", "test_c.py", "--first", "test_b.py")
    result.assert_outcomes(passed=4)
    ran = [line.split()[0] for line in result.outlines if " PASSED" in line]
    assert ran == ["test_c.py::test_4", "test_b.py::test_3", "test_a.py::test_1", "test_a.py::test_2"], ran


def test_tests_moved_to_the_engine_tier_run_there_at_its_end_and_not_in_the_fast_tier(pytester: pytest.Pytester):
    pytester.makepyfile(test_a="def test_1():\n    pass\n", test_b="def test_2():\n    pass\n",
                        test_z_engine="def test_3(engine):\n    pass\n")
    moved = ("--to-engine-tier", "test_a.py")
    engine = _run(pytester, "-vv", "-m", "engine", *moved)
    engine.assert_outcomes(passed=2, deselected=1)
    ran = [line.split()[0] for line in engine.outlines if " PASSED" in line]
    assert ran == ["test_z_engine.py::test_3", "test_a.py::test_1"], ran
    _run(pytester, "-vv", "-m", "not engine", *moved).assert_outcomes(passed=1, deselected=2)


def test_the_folders_make_test_moves_to_the_engine_tier_exist():
    """The Makefile's TO_ENGINE_TIER names prefixes that exist (a renamed folder would move nothing, silently)."""
    import re

    line = re.search(r"^TO_ENGINE_TIER := (.*)$", (ROOT / "Makefile").read_text(), re.M).group(1)
    prefixes = re.findall(r"--to-engine-tier (\S+)", line)
    assert prefixes, line
    for prefix in prefixes:
        assert list(ROOT.glob(prefix + "*")), f"--to-engine-tier {prefix}: no test file starts so"


def test_every_test_left_out_of_ci_is_one_make_test_long_runs():
    """A test marked `long_run` (tests/support.py) is skipped in CI; `make test-long` selects them by the Makefile's
    LONG_K (-k names): a long test that no name matches would run nowhere."""
    import ast
    import re

    text = (ROOT / "Makefile").read_text()
    names = re.search(r"^LONG_K := (.*?)(?<!\\)\n", text, re.S | re.M).group(1).replace("\\\n", " ").split(" or ")
    names = [n.strip() for n in names]
    long = []
    for path in (ROOT / "tests").rglob("test_*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef) and any(
                    isinstance(d, ast.Name) and d.id == "long_run" for d in node.decorator_list):
                long.append(node.name)
    assert len(long) >= 5, long  # the parse found them (others run short in CI, by HARNESS_LONG_TESTS)
    assert [n for n in long if not any(k in n for k in names)] == []
