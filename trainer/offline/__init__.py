"""Training without rollouts (loop.py): `harness train --from-run` on a recorded run (data.py) and `harness sft` on
chat records (chat_data.py)."""
