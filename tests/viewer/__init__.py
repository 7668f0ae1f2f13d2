"""Tests of `harness view` (harness/viewer/)."""
