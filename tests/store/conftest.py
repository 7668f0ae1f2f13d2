"""The store's tests' fixture: a fresh store."""

from __future__ import annotations

from pathlib import Path

import pytest

from harness.store.database import Store


@pytest.fixture
def store(tmp_path: Path):
    """A fresh store in tmp_path."""
    store = Store.open(tmp_path / "runs" / "harness.duckdb")
    yield store
    store.close()
