"""Tests of the recording proxy (proxy/)."""
