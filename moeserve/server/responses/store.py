"""Stored responses, for `previous_response_id` and GET / DELETE /v1/responses/{id}: in this API
process's memory, the most recently used kept, at most MAX_RESPONSES of them and MAX_CHARS
characters of the text they add (a response shares its history's items with the response it
continues; the newest is kept whatever its size). With `--api-servers N` each API process has
its own store: a follow-up that lands on another process finds nothing (a 404 that says so).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from pydantic import TypeAdapter

from moeserve.server.responses.protocol import InputItem

MAX_RESPONSES = 1024
MAX_CHARS = 64 << 20
_ITEM = TypeAdapter(InputItem)


@dataclass(frozen=True, slots=True)
class StoredResponse:
    body: dict[str, Any]  # the response object, as sent
    items: list[Any]  # the conversation's items: its history, its input, then its output
    num_chars: int  # the text this response added


class ResponseStore:
    def __init__(self, max_responses: int = MAX_RESPONSES, max_chars: int = MAX_CHARS) -> None:
        self.max_responses = max_responses
        self.max_chars = max_chars
        self._responses: OrderedDict[str, StoredResponse] = OrderedDict()
        self._chars = 0

    def __len__(self) -> int:
        return len(self._responses)

    def add(self, body: dict[str, Any], conversation: list[Any], num_new_chars: int) -> None:
        """Keep a finished response: `conversation` is its history and input items; its output
        items are added to them (as the input items they are when sent back)."""
        output = [_ITEM.validate_python(item) for item in body["output"]]
        chars = num_new_chars + sum(len(str(item)) for item in body["output"])
        self.delete(body["id"])
        self._responses[body["id"]] = StoredResponse(body, [*conversation, *output], chars)
        self._chars += chars
        while len(self._responses) > 1 and (len(self._responses) > self.max_responses
                                            or self._chars > self.max_chars):
            _, old = self._responses.popitem(last=False)
            self._chars -= old.num_chars

    def get(self, response_id: str) -> StoredResponse | None:
        stored = self._responses.get(response_id)
        if stored is not None:
            self._responses.move_to_end(response_id)
        return stored

    def delete(self, response_id: str) -> bool:
        stored = self._responses.pop(response_id, None)
        if stored is None:
            return False
        self._chars -= stored.num_chars
        return True
