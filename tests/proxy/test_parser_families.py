"""The family table covers every parser name vLLM accepts, no more, in the order proxy/parsing/native.py lists them."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import proxy.parsing.families as parser_families
from proxy.parsing.families import REASONING_PARSER_FAMILIES, TOOL_PARSER_FAMILIES
from proxy.parsing.native import REASONING_PARSERS, TOOL_PARSERS


def test_every_tool_parser_has_a_family_in_order():
    assert list(TOOL_PARSER_FAMILIES) == list(TOOL_PARSERS)


def test_every_reasoning_parser_has_a_family_in_order():
    assert list(REASONING_PARSER_FAMILIES) == list(REASONING_PARSERS)


@pytest.mark.parametrize("table", [TOOL_PARSER_FAMILIES, REASONING_PARSER_FAMILIES], ids=["tool", "reasoning"])
def test_every_family_is_a_short_nonempty_line(table):
    for name, families in table.items():
        assert isinstance(families, str) and families.strip() == families and families, name
        assert "\n" not in families and len(families) <= 70, name


def test_the_module_imports_nothing():
    """Pure data: the proxy's core reads it without vLLM, torch or transformers."""
    tree = ast.parse(Path(parser_families.__file__).read_text())
    assert not [node for node in ast.walk(tree) if isinstance(node, (ast.Import, ast.ImportFrom))]
