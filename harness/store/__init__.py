"""The store layer, over the core: the DuckDB schema as append-only migrations (`schema.py`), the store
(`database.py`), the proxy's batched writer (`recorder.py`), read-only SQL (`sql.py`, `readonly.py`), recorded
episodes merged into stored samples (`samples.py`), exports (`export.py`, `retokenize.py`), and the file that tells
other processes which proxy holds a database open (`live.py`). Never imports torch."""

from harness.store.database import Store

__all__ = ["Store"]
