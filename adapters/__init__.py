"""Adapters, above the trainer: what joins harness to other software, loaded by name when chosen, never imported by
the layers below. verl's agent loop (`verl_loop.py`) runs the unmodified agent inside verl's workers, with the
proxy served from verl's own rollout servers (`token_server.py`)."""
