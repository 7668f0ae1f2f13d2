"""The reward of examples/arithmetic_agent: the right number, best alone.

    reward = 1.0                                          the reply is the right number alone ("12", "12.")
    reward = 0.5 * right + 0.4 * max(0, 1 - chars / 40)   anything else

`right` is 1 when the reply's last number is the task's answer, `chars` the reply's length without surrounding
whitespace. A right reply scores at least 0.5 and a wrong one at most 0.4, so success_threshold 0.5 (the config's)
counts right answers, and pass@n the sums answered right at least once in n. The length term makes the signal
dense: SmolLM2-135M-Instruct as shipped gets about a fifth of the sums right, in a sentence ("The answer is 12.");
a right equation ("7 + 5 = 12") scores 0.8, the number alone 1.0.
"""

from __future__ import annotations

import re

_NUMBER = re.compile(r"-?\d+")
_BARE = re.compile(r"-?\d+\.?")


def bare_number(task: dict, answer: str | None, calls: list[dict]) -> dict:
    text = (answer or "").strip()
    numbers = _NUMBER.findall(text)
    right = bool(numbers) and int(numbers[-1]) == int(task["answer"])
    if right and _BARE.fullmatch(text):
        return {"reward": 1.0, "right": True, "bare": True}
    reward = 0.5 * right + 0.4 * max(0.0, 1.0 - len(text) / 40) if text else 0.0
    return {"reward": round(reward, 6), "right": right, "bare": bool(_BARE.fullmatch(text))}
