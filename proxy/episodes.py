"""Episode attribution: which episode a call belongs to, and its place in that episode.

Three ways in, tried in this order:
- the URL: `/e/<episode>/v1/...` (the agent is given an episode-scoped OPENAI_BASE_URL);
- the api key: `OPENAI_API_KEY=<episode token>`, a secret minted by `POST /harness/episodes`;
- neither: the run's default episode.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import re
import secrets
import time
from collections import OrderedDict
from dataclasses import dataclass

from harness.core.records import Episode
from harness.store.database import Store
from harness.store.recorder import Recorder
from proxy.guard import ended_why
from proxy.http_json import ApiError

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
    open_calls: int = 0  # calls started and not yet handed to the recorder
    ended: tuple[str, str] | None = None  # (reason, why) once the proxy ended the episode (proxy/guard.py)


class Episodes:
    """Per-process episode table: ids, tokens, and the next call index of each episode.

    Bounded: past `max_states` episodes the least recently used one with no call open is forgotten. Its next call
    (if any) looks its numbering up in the store again, after the recorder has written every call handed to it
    before the eviction, so numbering never repeats. Episode tokens need no table: a token is the episode id and
    its HMAC under a key this process drew at start, so a restarted proxy refuses the tokens of the last one.
    """

    def __init__(self, run_id: str, *, auto_open: bool, store: Store, recorder: Recorder, max_states: int = 65536,
                 guard_ends: bool = False):
        if max_states < 1:
            raise ValueError(f"max_states must be >= 1, got {max_states!r}")
        self.run_id = run_id
        self.default_id = f"{run_id}-default"
        self.auto_open = auto_open
        self.max_states = max_states
        self.guard_ends = guard_ends  # a degenerate completion ends its episode (the guard's end_episode)
        self.evicted = 0  # episodes forgotten so far
        self._store, self._recorder = store, recorder
        self._key = secrets.token_bytes(32)
        self._states: OrderedDict[str, _State] = OrderedDict()  # least recently used first
        self._evicted_mark: tuple[int, int] | None = None  # the recorder's count at the latest eviction
        self._loading: dict[str, asyncio.Future] = {}  # episodes being looked up in the store

    async def open(self, episode_id: str | None = None, *, source: str = "api_key", meta: dict | None = None,
                   new: bool = False) -> dict:
        """Open an episode (minting an id if none is given); returns its id and its api key.

        `new`: the caller knows the id was never used (a run's own ids), so the store is not asked where the
        episode's numbering goes on.
        """
        minted = not episode_id
        episode_id = check_episode_id(episode_id) if episode_id else "ep-" + secrets.token_hex(8)
        await self._ensure(episode_id, source, meta or {}, new=new or minted)
        token = f"{TOKEN_PREFIX}{episode_id}.{self._mac(episode_id)}"
        return {"episode_id": episode_id, "api_key": token, "base_path": f"/e/{episode_id}/v1"}

    def is_token(self, api_key: str | None) -> bool:
        return self._episode_of(api_key) is not None

    async def resolve(self, url_episode: str | None, api_key: str | None) -> str:
        """The episode a call belongs to; ApiError for an unknown episode or token."""
        if url_episode is not None:
            check_episode_id(url_episode)
            await self._ensure(url_episode, "url", {}, known_only=not self.auto_open)
            return url_episode
        if api_key and api_key.startswith(TOKEN_PREFIX):
            episode_id = self._episode_of(api_key)
            if episode_id is None:
                raise ApiError(
                    401, "unknown episode token: the api key looks like an episode token but this proxy never "
                    "minted it (was the proxy restarted?)", code="unknown_episode_token",
                )
            await self._ensure(episode_id, "api_key", {})
            return episode_id
        await self._ensure(self.default_id, "default", {})
        return self.default_id

    async def start_call(self, episode_id: str) -> int:
        """The call index of a new call of a resolved episode; pair with `end_call` once the call is recorded."""
        state = self._states.get(episode_id)
        if state is None:  # forgotten since it was resolved: look it up again
            await self._ensure(episode_id, "url", {})
            state = self._states[episode_id]
        self._states.move_to_end(episode_id)
        state.open_calls += 1
        state.next_index += 1
        return state.next_index - 1

    def end(self, episode_id: str, reason: str, why: str) -> None:
        """End an episode early (the guard found a degenerate completion): its later calls are refused. Held with
        its numbering; an episode forgotten since (past `max_states` others) is ended again when it comes back, from
        the finding recorded in the store."""
        state = self._states.get(episode_id)
        if state is not None and state.ended is None:
            state.ended = (reason, why)

    def ended(self, episode_id: str) -> tuple[str, str] | None:
        """(reason, why) if the episode was ended early, else None."""
        state = self._states.get(episode_id)
        return state.ended if state is not None else None

    def end_call(self, episode_id: str) -> None:
        """The call was handed to the recorder (or never will be): its episode may be forgotten again."""
        self._states[episode_id].open_calls -= 1
        self._evict()

    def __len__(self) -> int:
        return len(self._states)

    def _mac(self, episode_id: str) -> str:
        return hmac.new(self._key, episode_id.encode(), hashlib.sha256).hexdigest()[:32]

    def _episode_of(self, api_key: str | None) -> str | None:
        if not api_key or not api_key.startswith(TOKEN_PREFIX):
            return None
        episode_id, _, mac = api_key[len(TOKEN_PREFIX):].rpartition(".")
        if not _EPISODE_ID.match(episode_id) or not hmac.compare_digest(mac, self._mac(episode_id)):
            return None
        return episode_id

    def _evict(self) -> None:
        while len(self._states) > self.max_states:
            newest = next(reversed(self._states))
            victim = next((e for e, s in self._states.items() if s.open_calls == 0 and e != newest), None)
            if victim is None:  # every other episode has a call open: nothing can go yet
                return
            del self._states[victim]
            self.evicted += 1
            self._evicted_mark = self._recorder.mark()

    async def _ensure(self, episode_id: str, source: str, meta: dict, new: bool = False,
                      known_only: bool = False) -> None:
        if episode_id in self._states:
            self._states.move_to_end(episode_id)
            return
        if new:
            self._add(episode_id, 0, Episode(episode_id, self.run_id, time.time(), source, meta))
            return
        loading = self._loading.get(episode_id)
        if loading is not None:  # another call of the same episode is looking it up: wait for that
            await asyncio.shield(loading)
            return
        loading = self._loading[episode_id] = asyncio.get_running_loop().create_future()
        try:
            known, start, finding = await asyncio.to_thread(self._look_up, episode_id, self._evicted_mark)
            if known_only and not known:
                raise ApiError(
                    404, f"unknown episode {episode_id!r}: open it first (POST /harness/episodes) or start the "
                    "proxy with auto_episodes on", code="unknown_episode",
                )
            ended = ("guard", ended_why(*finding)) if self.guard_ends and finding is not None else None
            self._add(episode_id, start, None if known else Episode(episode_id, self.run_id, time.time(), source, meta),
                      ended)
            loading.set_result(None)
        except BaseException as exc:
            loading.set_exception(exc if isinstance(exc, Exception) else RuntimeError("episode lookup cancelled"))
            loading.exception()  # retrieved here, so an unwaited failure is not logged as lost
            raise
        finally:
            del self._loading[episode_id]

    def _look_up(self, episode_id: str, evicted_mark: tuple[int, int] | None) -> tuple[bool, int, tuple | None]:
        """(whether the store knows the episode, its next call index, its first degenerate finding); an episode may
        go on from an earlier run, or have been forgotten here, once the calls it had when it was are written."""
        if evicted_mark is not None:
            self._recorder.flush(upto=evicted_mark)
        return self._store.episode_progress(episode_id, degenerate=self.guard_ends)

    def _add(self, episode_id: str, next_index: int, new: Episode | None,
             ended: tuple[str, str] | None = None) -> None:
        """Track an episode; `new`: its record, when the store does not have it yet."""
        if new is not None:
            self._recorder.record_episode(new)
        self._states[episode_id] = _State(next_index, ended=ended)
        self._evict()
