"""Stored responses, for `previous_response_id` and GET / DELETE /v1/responses/{id} (and its
input_items): an SQLite database, so that every API process of a server sees the same store.

    one API process          ":memory:", unless --responses-store names a file
    --api-servers N          a file in the server's IPC directory, which all N open (removed
                             with the directory at shutdown), unless --responses-store names one
    --responses-store PATH   that file: the responses outlive the server (a restart finds them)

A row is one response: its object as sent, and its conversation's items (the history it
continued, its input, then its output: what a follow-up's prompt is made of), each zlib'd JSON,
with its status and the server that wrote it (`owner`). The most recently used are kept, at most
MAX_RESPONSES rows and MAX_BYTES of stored bytes (the newest is kept whatever its size, and a
background response in flight is never dropped). Input items that came without an id get one
when stored (`msg_...`, `fc_...`, `fco_...`, `rs_...`), so the input_items listing can page by id.

A background response (responses/background.py) is stored "queued" when accepted; `update`
writes its progress and its end only while it is still in flight, so a `cancel` (from any API
process) or a DELETE is final. A streamed one's events are kept beside it (`events` table,
their bytes counted in its size) for the API processes that tail them. A store that opens a
file finds the rows another server left in flight (it stopped before they finished) and marks
them failed.

Writes take SQLite's write lock (WAL journal, a busy timeout of BUSY_TIMEOUT_MS); a database of
format 1 is brought to this one (two columns added); one of another format is refused with its
path named.
"""

from __future__ import annotations

import contextlib
import sqlite3
import time
import uuid
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import msgspec
from pydantic import TypeAdapter

from moeserve.server.responses.protocol import (
    FunctionCallItem,
    FunctionCallOutputItem,
    InputItem,
    MessageItem,
)

MAX_RESPONSES = 1024
MAX_BYTES = 64 << 20
BUSY_TIMEOUT_MS = 5000
SCHEMA_VERSION = 2
IN_FLIGHT = ("queued", "in_progress")  # a background response's statuses before its end
_ITEM = TypeAdapter(InputItem)
_ITEMS = TypeAdapter(list[InputItem])
# a streamed background response's events, each as sent (its bytes count in the response's size)
_EVENTS = ("CREATE TABLE IF NOT EXISTS events (response_id TEXT NOT NULL, seq INTEGER NOT NULL, "
           "data BLOB NOT NULL, PRIMARY KEY (response_id, seq))")
_SCHEMA = ("CREATE TABLE IF NOT EXISTS responses (id TEXT PRIMARY KEY, body BLOB NOT NULL, "
           "items BLOB NOT NULL, num_input INTEGER NOT NULL, size INTEGER NOT NULL, "
           "used INTEGER NOT NULL, status TEXT NOT NULL DEFAULT 'completed', "
           "owner TEXT NOT NULL DEFAULT '', streamed INTEGER NOT NULL DEFAULT 0)",
           "CREATE INDEX IF NOT EXISTS responses_used ON responses (used)", _EVENTS)
_FROM_1 = ("ALTER TABLE responses ADD COLUMN status TEXT NOT NULL DEFAULT 'completed'",
           "ALTER TABLE responses ADD COLUMN owner TEXT NOT NULL DEFAULT ''",
           "ALTER TABLE responses ADD COLUMN streamed INTEGER NOT NULL DEFAULT 0", _EVENTS)
LEFT_BEHIND = {"code": "server_error",
               "message": "the server that ran this background response stopped before it "
                          "finished"}


@dataclass(frozen=True, slots=True)
class StoredResponse:
    body: dict[str, Any]  # the response object, as sent
    items: list[Any]  # the conversation's items: its history, its input, then its output
    num_input: int  # items[:num_input] were its input (the history's included)


class ResponseStore:
    """The stored responses (module docstring); `path` an SQLite file or ":memory:"; `owner`
    names the server (the same for all its API processes; default: one of its own)."""

    def __init__(self, path: str = ":memory:", max_responses: int = MAX_RESPONSES,
                 max_bytes: int = MAX_BYTES, owner: str | None = None) -> None:
        self.path = path
        self.max_responses = max_responses
        self.max_bytes = max_bytes
        self.owner = owner or uuid.uuid4().hex
        try:
            self._db = sqlite3.connect(path, timeout=BUSY_TIMEOUT_MS / 1000,
                                       isolation_level=None, check_same_thread=False)
            if path != ":memory:":
                self._rows("PRAGMA journal_mode=WAL")
            self._db.execute("BEGIN IMMEDIATE")
            try:
                [(version,)] = self._rows("PRAGMA user_version")
                [(tables,)] = self._rows("SELECT count(*) FROM sqlite_master")
                if tables and version not in (1, SCHEMA_VERSION):
                    raise ValueError(f"the responses store {path!r} was written in format "
                                     f"{version}, this moeserve writes {SCHEMA_VERSION}: "
                                     "remove it or name another file")
                for statement in (_FROM_1 if tables and version == 1 else _SCHEMA):
                    self._db.execute(statement)
                self._db.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")
                self._fail_left_behind()
            finally:
                if self._db.in_transaction:
                    self._db.execute("COMMIT")
        except sqlite3.Error as e:
            raise ValueError(f"the responses store {path!r} cannot be opened: {e}") from None

    def __len__(self) -> int:
        [(count,)] = self._rows("SELECT count(*) FROM responses")
        return int(count)

    def add(self, body: dict[str, Any], conversation: list[Any],
            streamed: bool = False) -> None:
        """Keep a response (finished, or a background one just accepted; `streamed`: its
        events will be kept too): `conversation` is its history and input items; its output
        items are added after them (as the input items they are when sent back)."""
        row = self._row(body, conversation)
        with self._write():
            self._db.execute("INSERT OR REPLACE INTO responses VALUES "
                             "(?, ?, ?, ?, ?, ?, ?, ?, ?)", (*row, int(streamed)))
            rows = self._rows("SELECT id, size, status FROM responses ORDER BY used DESC")
            kept = total = 0
            gone = []
            for response_id, row_size, status in rows:
                kept += 1
                total += row_size
                if kept > 1 and status not in IN_FLIGHT and (
                        kept > self.max_responses or total > self.max_bytes):
                    gone.append((response_id,))
            self._db.executemany("DELETE FROM responses WHERE id = ?", gone)
            self._db.executemany("DELETE FROM events WHERE response_id = ?", gone)

    def update(self, body: dict[str, Any], conversation: list[Any]) -> bool:
        """A background response's progress or end, written only while its row is in flight:
        False (nothing written) once it was cancelled, failed or deleted."""
        row = self._row(body, conversation)
        with self._write():
            written = self._db.execute(
                "UPDATE responses SET body = ?, items = ?, num_input = ?, "
                "size = ? + (SELECT coalesce(sum(length(data)), 0) FROM events WHERE "
                "response_id = responses.id), used = ?, "
                f"status = ? WHERE id = ? AND status IN {IN_FLIGHT}", (*row[1:7], row[0]))
        return written.rowcount > 0

    def end(self, response_id: str, status: str,
            error: dict[str, str] | None = None) -> dict[str, Any] | None:
        """End a background response in flight with `status` ("cancelled", "failed" with
        `error`); its object as it is now (ended or not), or None if it is not stored."""
        with self._write():
            rows = self._rows("SELECT body, status FROM responses WHERE id = ?", (response_id,))
            if not rows:
                return None
            [(packed, current)] = rows
            body = msgspec.json.decode(zlib.decompress(packed))
            if current in IN_FLIGHT:
                body = {**body, "status": status, "error": error}
                self._db.execute("UPDATE responses SET body = ?, status = ? WHERE id = ?",
                                 (zlib.compress(msgspec.json.encode(body), 1), status,
                                  response_id))
        return body

    def statuses(self, response_ids: list[str]) -> dict[str, str]:
        """The stored ones' statuses (an id not stored is absent)."""
        rows = self._rows(f"SELECT id, status FROM responses WHERE id IN "
                          f"({', '.join('?' * len(response_ids))})", tuple(response_ids))
        return dict(rows)

    def _row(self, body: dict[str, Any], conversation: list[Any]) -> tuple[Any, ...]:
        """The columns of a row: id, body, items, num_input, size, used, status, owner."""
        inputs = [_with_id(item) for item in conversation]
        items = [*inputs, *(_ITEM.validate_python(item) for item in body["output"])]
        packed_body = zlib.compress(msgspec.json.encode(body), 1)
        packed_items = zlib.compress(
            _ITEMS.dump_json(items, exclude_none=True, by_alias=True), 1)
        return (body["id"], packed_body, packed_items, len(inputs),
                len(packed_body) + len(packed_items), time.time_ns(), body["status"],
                self.owner)

    def _fail_left_behind(self) -> None:
        """Rows another server left in flight end failed (in the open's transaction)."""
        rows = self._rows(f"SELECT id, body FROM responses WHERE status IN {IN_FLIGHT} AND "
                          "owner != ?", (self.owner,))
        for response_id, packed in rows:
            body = {**msgspec.json.decode(zlib.decompress(packed)), "status": "failed",
                    "error": LEFT_BEHIND}
            self._db.execute("UPDATE responses SET body = ?, status = 'failed' WHERE id = ?",
                             (zlib.compress(msgspec.json.encode(body), 1), response_id))

    def get(self, response_id: str) -> StoredResponse | None:
        rows = self._rows("SELECT body, items, num_input FROM responses WHERE id = ?",
                          (response_id,))
        if not rows:
            return None
        [row] = rows
        with self._write():
            self._db.execute("UPDATE responses SET used = ? WHERE id = ?",
                             (time.time_ns(), response_id))
        return StoredResponse(msgspec.json.decode(zlib.decompress(row[0])),
                              _ITEMS.validate_json(zlib.decompress(row[1])), int(row[2]))

    def delete(self, response_id: str) -> bool:
        with self._write():
            deleted = self._db.execute("DELETE FROM responses WHERE id = ?", (response_id,))
            self._db.execute("DELETE FROM events WHERE response_id = ?", (response_id,))
        return deleted.rowcount > 0

    def append_events(self, response_id: str, events: list[tuple[int, bytes]]) -> bool:
        """A streamed background response's next events (sequence number, bytes as sent),
        kept while its row is in flight: False (nothing kept) once it ended or is gone."""
        with self._write():
            grown = self._db.execute(
                f"UPDATE responses SET size = size + ? WHERE id = ? AND status IN {IN_FLIGHT}",
                (sum(len(data) for _, data in events), response_id))
            if grown.rowcount == 0:
                return False
            self._db.executemany("INSERT OR REPLACE INTO events VALUES (?, ?, ?)",
                                 [(response_id, seq, data) for seq, data in events])
        return True

    def streamed(self, response_id: str) -> bool:
        """Whether it was accepted as a streamed background response (its events kept)."""
        rows = self._rows("SELECT streamed FROM responses WHERE id = ?", (response_id,))
        return bool(rows and rows[0][0])

    def events(self, response_id: str, after: int) -> list[tuple[int, bytes]]:
        """Its stored events past sequence number `after`, in order."""
        return [(int(seq), bytes(data)) for seq, data in self._rows(
            "SELECT seq, data FROM events WHERE response_id = ? AND seq > ? ORDER BY seq",
            (response_id, after))]

    def close(self) -> None:
        self._db.close()

    def _rows(self, sql: str, args: tuple[Any, ...] = ()) -> list[Any]:
        """A statement's rows, all read: a statement left unfinished would keep its read
        transaction open, and this connection would go on seeing that snapshot of the store
        (not what the other API processes write since)."""
        cursor = self._db.execute(sql, args)
        try:
            return cursor.fetchall()
        finally:
            cursor.close()

    @contextlib.contextmanager
    def _write(self) -> Iterator[None]:
        """BEGIN IMMEDIATE (the write lock, waited for up to the busy timeout) ... COMMIT, or
        ROLLBACK when the block raised."""
        self._db.execute("BEGIN IMMEDIATE")
        try:
            yield
        except BaseException:
            self._db.execute("ROLLBACK")
            raise
        self._db.execute("COMMIT")


_ID_PREFIXES = ((MessageItem, "msg"), (FunctionCallItem, "fc"),
                (FunctionCallOutputItem, "fco"))


def _with_id(item: Any) -> Any:
    """The item, with an id of its kind when it came without one."""
    if getattr(item, "id", None) is not None:
        return item
    prefix = next((p for kind, p in _ID_PREFIXES if isinstance(item, kind)), "rs")
    return item.model_copy(update={"id": f"{prefix}_{uuid.uuid4().hex}"})
