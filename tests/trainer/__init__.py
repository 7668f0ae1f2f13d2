"""Tests of the trainer (trainer/)."""
