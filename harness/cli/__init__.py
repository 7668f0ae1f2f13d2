"""The top layer: the `harness` command (`main.py`, one module per verb group) and `harness doctor`."""

from harness.cli.main import main

__all__ = ["main"]
