"""Episode attribution: which episode a call belongs to, and its place in that episode.

Three ways in, tried in this order:
- the URL: `/e/<episode>/v1/...` (the agent is given an episode-scoped OPENAI_BASE_URL);
- the api key: `OPENAI_API_KEY=<episode token>`, a secret minted by `POST /harness/episodes`;
- neither: the run's default episode.
"""

from __future__ import annotations

import asyncio
import re
import secrets
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from harness.records import Episode
from proxy.errors import ApiError

TOKEN_PREFIX = "hx-ep-"
_EPISODE_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:@+-]{0,127}$")


def check_episode_id(episode_id: str) -> str:
    if not _EPISODE_ID.match(episode_id):
        raise ApiError(
            400, f"episode id {episode_id[:140]!r} is not valid: use 1-128 characters from letters, digits "
            "and . _ : @ + - (starting with a letter or digit)", code="invalid_episode_id",
        )
    return episode_id


@dataclass
class _State:
    next_index: int


class Episodes:
    """Per-process episode table: ids, minted tokens, and the next call index of each episode."""

    def __init__(
        self,
        run_id: str,
        *,
        auto_open: bool,
        next_index_from_store: Callable[[str], Awaitable[int]],
        on_new: Callable[[Episode], None],
    ):
        self.run_id = run_id
        self.default_id = f"{run_id}-default"
        self.auto_open = auto_open
        self._next_index_from_store = next_index_from_store
        self._on_new = on_new
        self._states: dict[str, _State] = {}
        self._tokens: dict[str, str] = {}
        self._loading: dict[str, asyncio.Future] = {}  # new episodes being looked up in the store

    async def open(self, episode_id: str | None = None, *, source: str = "api_key", meta: dict | None = None,
                   new: bool = False) -> dict:
        """Open an episode (minting an id if none is given); returns its id and its api key.

        `new`: the caller knows the id was never used (a run's own ids), so the store is not asked where the
        episode's numbering goes on.
        """
        minted = not episode_id
        episode_id = check_episode_id(episode_id) if episode_id else "ep-" + secrets.token_hex(8)
        await self._ensure(episode_id, source, meta or {}, new=new or minted)
        token = TOKEN_PREFIX + secrets.token_urlsafe(24)
        self._tokens[token] = episode_id
        return {"episode_id": episode_id, "api_key": token, "base_path": f"/e/{episode_id}/v1"}

    def is_token(self, api_key: str | None) -> bool:
        return bool(api_key) and api_key in self._tokens

    async def resolve(self, url_episode: str | None, api_key: str | None) -> str:
        """The episode a call belongs to; ApiError for an unknown episode or token."""
        if url_episode is not None:
            check_episode_id(url_episode)
            if url_episode not in self._states and not self.auto_open:
                raise ApiError(
                    404, f"unknown episode {url_episode!r}: open it first (POST /harness/episodes) or start the "
                    "proxy with auto_episodes on", code="unknown_episode",
                )
            await self._ensure(url_episode, "url", {})
            return url_episode
        if api_key and api_key.startswith(TOKEN_PREFIX):
            episode_id = self._tokens.get(api_key)
            if episode_id is None:
                raise ApiError(
                    401, "unknown episode token: the api key looks like an episode token but this proxy never "
                    "minted it (was the proxy restarted?)", code="unknown_episode_token",
                )
            return episode_id
        await self._ensure(self.default_id, "default", {})
        return self.default_id

    def next_index(self, episode_id: str) -> int:
        state = self._states[episode_id]
        index = state.next_index
        state.next_index += 1
        return index

    async def _ensure(self, episode_id: str, source: str, meta: dict, new: bool = False) -> None:
        if episode_id in self._states:
            return
        if new:
            self._states[episode_id] = _State(0)
            self._on_new(Episode(episode_id, self.run_id, time.time(), source, meta))
            return
        loading = self._loading.get(episode_id)
        if loading is not None:  # another call of the same new episode is looking it up: wait for that
            await asyncio.shield(loading)
            return
        loading = self._loading[episode_id] = asyncio.get_running_loop().create_future()
        try:
            start = await self._next_index_from_store(episode_id)  # an episode may go on from an earlier run
            self._states[episode_id] = _State(start)
            self._on_new(Episode(episode_id, self.run_id, time.time(), source, meta))
            loading.set_result(None)
        except BaseException as exc:
            loading.set_exception(exc if isinstance(exc, Exception) else RuntimeError("episode lookup cancelled"))
            loading.exception()  # retrieved here, so an unwaited failure is not logged as lost
            raise
        finally:
            del self._loading[episode_id]
