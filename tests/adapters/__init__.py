"""Tests of the adapters (adapters/)."""
