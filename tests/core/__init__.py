"""Tests of the records and the merger (harness/core/)."""
