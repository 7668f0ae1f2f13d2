"""Tests, laid out like the code: one folder per layer (core, store, proxy, running, trainer, adapters, cli, viewer);
files named `*_engine.py` are the engine tier (tests/tiers.py)."""
