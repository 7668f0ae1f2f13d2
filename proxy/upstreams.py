"""Several engines serving the same policy behind one proxy: which engine serves a call.

- **Episode affinity.** An episode's calls stay on the engine that served its first call, so each next turn finds
  its prefix in that engine's cache. A new episode goes to the engine with the fewest calls in flight (then the
  fewest episodes).
- **Failover.** An engine that cannot be reached, or that answers a server error and then fails its health
  check (a dying vLLM answers 500 "EngineCore encountered an issue" before it stops listening), is marked down
  for `retry_after_s`; the call is retried on another engine before anything reached the agent, and the
  episodes that lived there move on their next call. A server error from a healthy engine goes to the agent.
  When every engine is down, the one down longest is tried anyway (the agent then gets the 502 it would have).

With one engine this is a constant: every call goes to it.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict

import aiohttp

log = logging.getLogger("harness.proxy")

# Sent with every call to a policy engine: an engine that routes by episode (adapters/token_server.py) keeps an
# episode's calls where its prefix is cached. vLLM ignores it.
EPISODE_HEADER = "X-Harness-Episode"


class Engines:
    def __init__(self, bases: tuple[str, ...], *, retry_after_s: float = 30.0, max_episodes: int = 65536):
        if not bases:
            raise ValueError("at least one engine URL is needed")
        self.bases = bases
        self.retry_after_s = retry_after_s
        self.max_episodes = max_episodes
        self.in_flight = dict.fromkeys(bases, 0)
        self.episodes = dict.fromkeys(bases, 0)  # episodes living on each engine
        self.down_until: dict[str, float] = {}
        self._home: OrderedDict[str, str] = OrderedDict()  # episode -> its engine, least recently used first

    @property
    def single(self) -> bool:
        return len(self.bases) == 1

    def is_up(self, base: str) -> bool:
        until = self.down_until.get(base)
        if until is None:
            return True
        if time.monotonic() >= until:
            del self.down_until[base]
            log.info("engine %s: trying it again", base)
            return True
        return False

    def pick(self, episode_id: str) -> str:
        """The engine for this episode's next call."""
        if self.single:
            return self.bases[0]
        home = self._home.get(episode_id)
        if home is not None and self.is_up(home):
            self._home.move_to_end(episode_id)
            return home
        up = [b for b in self.bases if self.is_up(b)]
        if up:
            chosen = min(up, key=lambda b: (self.in_flight[b], self.episodes[b], self.bases.index(b)))
        else:  # all down: the one that has been down longest
            chosen = min(self.bases, key=lambda b: self.down_until.get(b, 0.0))
        if home is not None:
            self.episodes[home] -= 1
        self._home[episode_id] = chosen
        self._home.move_to_end(episode_id)
        self.episodes[chosen] += 1
        while len(self._home) > self.max_episodes:
            _, gone = self._home.popitem(last=False)
            self.episodes[gone] -= 1
        return chosen

    def any_up(self) -> str:
        """An engine for calls of no episode (model lists, pass-through routes): the first one up."""
        return next((b for b in self.bases if self.is_up(b)), self.bases[0])

    def mark_down(self, base: str, why: str) -> bool:
        """Take an engine out for a while; True if another engine is up to retry on."""
        if self.single:
            return False
        self.down_until[base] = time.monotonic() + self.retry_after_s
        log.warning("engine %s is down (%s): its episodes move to the other engines for %.0f s", base, why,
                    self.retry_after_s)
        return any(self.is_up(b) for b in self.bases if b != base)

    def status(self) -> list[dict]:
        return [{"url": b, "up": self.is_up(b), "in_flight": self.in_flight[b], "episodes": self.episodes[b]}
                for b in self.bases]


async def healthy(session: aiohttp.ClientSession, base: str, timeout_s: float = 2.0) -> bool:
    """Whether the engine answers GET /health with 200 within `timeout_s`."""
    try:
        async with session.get(f"{base}/health", timeout=aiohttp.ClientTimeout(total=timeout_s)) as resp:
            return resp.status == 200
    except (TimeoutError, aiohttp.ClientError):
        return False
