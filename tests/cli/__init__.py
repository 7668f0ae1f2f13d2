"""Tests of the `harness` command (harness/cli/)."""
