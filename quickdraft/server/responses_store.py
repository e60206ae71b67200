"""The Responses API's stored responses (`store`, `previous_response_id`, GET / DELETE
/v1/responses/{id}, its input_items): what OpenAI's API keeps so that a client sends only the
new turn.

Stage: the HTTP edge, beside responses_api.py; the app holds one store (in a cluster the
ingress does, so every replica's answers are in it). A stored response keeps its Response
object and the conversation it answered, as input items: the earlier responses' items and
outputs it continued, then its own input (instructions are not carried over, as OpenAI's are
not). `previous_response_id` continues from there: the model sees that conversation, the
response's output items (a reasoning item among them is kept, and the chat templates drop an
earlier turn's reasoning as they do in a replay) and the new input, so a continuation equals
the whole conversation sent again, and the prefix cache holds the shared turns. A background
response (`background`, app.py `_background`) is stored when it is answered ("queued"), in
progress, and when it ends (completed, incomplete, failed with its error, or cancelled). A
streamed background response also keeps its events (`EventLogs`): while it runs and for the
last STREAMS_KEPT that ended, GET /v1/responses/{id}?stream=true&starting_after=N replays them
from N on and follows the rest.

Memory: responses are kept in memory up to a budget of bytes (their JSON), the least recently
used dropped first (`--responses-store-mb`; 0 stores nothing and refuses
`previous_response_id` by name). Each is visible only to the API key that created it (any
caller, where the server has no keys): a response id is not a capability.
"""

from __future__ import annotations

import asyncio
import json
import threading
from collections import OrderedDict
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from quickdraft.server.protocol import APIError
from quickdraft.server.responses_api import InputItem

LIST_LIMIT = 20  # input items a listing returns when it names no limit (OpenAI's)
STREAMS_KEPT = 64  # ended background streams whose events are kept for a late resume


@dataclass(frozen=True, slots=True)
class StoredResponse:
    owner: int | None  # the API key's index (None: a server without keys)
    items: list[InputItem]  # the conversation it answered, as input items, with ids
    response: dict[str, Any]  # the Response object as it was returned
    nbytes: int

    def input_items(self, limit: int, order: str, after: str | None) -> dict[str, Any]:
        """GET /v1/responses/{id}/input_items: a page of `items` (newest first for "desc"),
        starting past the item `after`."""
        items = [i.model_dump(exclude_none=True) for i in self.items]
        if order == "desc":
            items.reverse()
        if after is not None:
            ids = [i["id"] for i in items]
            if after not in ids:
                raise APIError(400, f"after: no input item {after!r} in this response", "after")
            items = items[ids.index(after) + 1 :]
        page = items[:limit]
        return {
            "object": "list",
            "data": page,
            "first_id": page[0]["id"] if page else None,
            "last_id": page[-1]["id"] if page else None,
            "has_more": len(items) > limit,
        }


class ResponseStore:
    """Stored responses by id, least recently used dropped past `max_bytes`."""

    def __init__(self, max_bytes: int) -> None:
        if max_bytes < 0:
            raise ValueError(f"max_bytes must be >= 0, got {max_bytes}")
        self.max_bytes = max_bytes
        self.nbytes = 0
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()
        self._lock = threading.Lock()  # the event loop and a stream's end share it

    @property
    def enabled(self) -> bool:
        return self.max_bytes > 0

    def __len__(self) -> int:
        return len(self._entries)

    def put(self, owner: int | None, items: list[InputItem], response: dict[str, Any]) -> bool:
        """Keep `response` (its "id") with the conversation `items` it answered; False where it
        alone is larger than the whole budget (then nothing is kept)."""
        dumped = [i.model_dump(exclude_none=True) for i in items]
        nbytes = len(json.dumps([dumped, response], separators=(",", ":"), default=str))
        if nbytes > self.max_bytes:
            return False
        entry = StoredResponse(owner, items, response, nbytes)
        with self._lock:
            old = self._entries.pop(response["id"], None)
            if old is not None:
                self.nbytes -= old.nbytes
            self._entries[response["id"]] = entry
            self.nbytes += nbytes
            while self.nbytes > self.max_bytes:
                _, dropped = self._entries.popitem(last=False)
                self.nbytes -= dropped.nbytes
        return True

    def get(self, rid: str, owner: int | None, param: str | None = None) -> StoredResponse:
        """The stored response `rid` of `owner`; APIError 404 where there is none (never
        stored, dropped, deleted, or another key's), naming `param` when a field named it."""
        with self._lock:
            entry = self._entries.get(rid)
            if entry is not None and entry.owner == owner:
                self._entries.move_to_end(rid)
                return entry
        where = f"{param}: " if param else ""
        raise APIError(404, f"{where}no stored response with id {rid!r}", param, "not_found")

    def delete(self, rid: str, owner: int | None) -> None:
        self.get(rid, owner)
        with self._lock:
            entry = self._entries.pop(rid, None)
            if entry is not None:
                self.nbytes -= entry.nbytes


class EventLog:
    """A streamed background response's events (SSE text, event i with sequence_number i), in
    order, for every client that follows it: the one that asked, and those that resume it."""

    def __init__(self) -> None:
        self.events: list[str] = []
        self.done = False
        self._changed = asyncio.Event()

    def append(self, event: str) -> None:
        self.events.append(event)
        self._wake()

    def close(self) -> None:
        self.done = True
        self._wake()

    def _wake(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    async def follow(self, after: int = -1) -> AsyncIterator[str]:
        """The events after sequence number `after`, as they come, until the response ends."""
        i = after + 1
        while True:
            if i < len(self.events):
                yield self.events[i]
                i += 1
            elif self.done:
                return
            else:
                await self._changed.wait()


class EventLogs:
    """The event logs of streamed background responses by id: the running ones, and the last
    `keep` that ended (their events replay to a client that resumes late)."""

    def __init__(self, keep: int = STREAMS_KEPT) -> None:
        self.keep = keep
        self._logs: OrderedDict[str, EventLog] = OrderedDict()

    def open(self, rid: str) -> EventLog:
        log = self._logs[rid] = EventLog()
        ended = [k for k, v in self._logs.items() if v.done]
        for k in ended[: max(0, len(ended) - self.keep)]:
            del self._logs[k]
        return log

    def get(self, rid: str) -> EventLog | None:
        return self._logs.get(rid)
