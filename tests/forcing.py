"""A model that writes what a test needs, on the real engine: a vLLM logits processor (started with
`--logits-processors tests.forcing:ScriptedReplies`) that forces each generating request's reply, in the order the
requests reach the engine, to the first text of the JSON list in the file HARNESS_SCRIPTED_REPLIES (taken off the
file, so a test sharing the engine writes the next list), then the model's end of turn. For agents whose requests a
test cannot add a regex to (coding CLIs as they ship): the engine still renders, tokenizes, samples (the forced
token is the only one left) and returns its own ids and logprobs, and the proxy's continuity and the merge see the
real thing.

An entry is a text (the next request's reply) or an object for agents whose requests race (a parent and its
sub-agent): {"reply": text, "when": s, "unless": s, "fill": {name: regex}} is the reply of the first request whose
prompt (decoded) holds `when` and not `unless`, with each "{name}" in it replaced by the regex's first group on that
prompt (an id the agent was given). A request takes the first entry that fits; the entries left keep their order.

A request asking for one token (harness run's probe of the engine) is not scripted; a request arriving when the
list is empty, or that no entry fits, is the random model's.
"""

from __future__ import annotations

import json
import os
import re

import torch
from transformers import AutoTokenizer
from vllm.v1.sample.logits_processor.builtin import process_dict_updates
from vllm.v1.sample.logits_processor.interface import BatchUpdate, LogitsProcessor

REPLIES_ENV = "HARNESS_SCRIPTED_REPLIES"


class ScriptedReplies(LogitsProcessor):
    def __init__(self, vllm_config, device: torch.device, is_pin_memory: bool):
        self.path = os.environ.get(REPLIES_ENV)
        self.tokenizer = AutoTokenizer.from_pretrained(vllm_config.model_config.tokenizer)
        self.active: dict[int, tuple[list[int], list[int]]] = {}  # batch index -> (target ids, output ids so far)

    def _next(self, prompt: list[int] | None) -> list[int] | None:
        """The ids of the first scripted reply that fits this prompt, taken off the file; None when none fits."""
        if not self.path or not os.path.exists(self.path):
            return None
        with open(self.path, encoding="utf-8") as f:
            replies = json.load(f)
        text = None
        for i, entry in enumerate(replies):
            if isinstance(entry, str):
                reply = entry
            else:
                if text is None:
                    text = self.tokenizer.decode(prompt or [])
                if entry.get("when", "") not in text or entry.get("unless", "\0") in text:
                    continue
                reply = entry["reply"]
                for name, pattern in entry.get("fill", {}).items():
                    found = re.search(pattern, text)
                    reply = reply.replace("{" + name + "}", found.group(1) if found else "")
            with open(self.path, "w", encoding="utf-8") as f:
                json.dump(replies[:i] + replies[i + 1:], f)
            return self.tokenizer.encode(reply, add_special_tokens=False) + [self.tokenizer.eos_token_id]
        return None

    def _add(self, params, prompt: list[int] | None, output: list[int]):
        if params.max_tokens == 1:
            return None
        target = self._next(prompt)
        return None if target is None else (target, output)

    def is_argmax_invariant(self) -> bool:
        return False

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        process_dict_updates(self.active, batch_update, self._add)

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        for index, (target, output) in self.active.items():
            if len(output) < len(target):
                logits[index].fill_(float("-inf"))
                logits[index, target[len(output)]] = 0.0
        return logits
