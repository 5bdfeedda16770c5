"""Stored responses (`store: true`) in SQLite: the response object (GET /v1/responses/{id}) and the
conversation it ends (the chat messages a `previous_response_id` continues from).

Bounded two ways: entries older than `max_age_s` are gone (deleted at every write, never returned), and
past `max_entries` the oldest are evicted. One connection, used from worker threads under a lock (each
call is a few small statements); WAL journaling, so a write does not wait on an fsync of the whole file.
The file opens on first use: a server that never stores a response never creates it.
"""

from __future__ import annotations

import asyncio
import json
import sqlite3
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

_SCHEMA = """
CREATE TABLE IF NOT EXISTS responses (
    id TEXT PRIMARY KEY,
    stored_at REAL NOT NULL,
    response TEXT NOT NULL,
    messages TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS responses_stored_at ON responses (stored_at);
"""


@dataclass
class StoredResponse:
    response: dict[str, Any]
    messages: list[dict[str, Any]]  # the conversation, ending with the response's own assistant turn


class ResponseStore:
    def __init__(
        self,
        path: Path | str,
        max_entries: int,
        max_age_s: float,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.path = path
        self.max_entries = max_entries
        self.max_age_s = max_age_s
        self._clock = clock
        self._lock = threading.Lock()
        self._conn: sqlite3.Connection | None = None

    def _db(self) -> sqlite3.Connection:
        if self._conn is None:
            if str(self.path) != ":memory:":
                Path(self.path).parent.mkdir(parents=True, exist_ok=True)
            conn = sqlite3.connect(str(self.path), check_same_thread=False, isolation_level=None)
            conn.execute("PRAGMA journal_mode=WAL")
            conn.execute("PRAGMA synchronous=NORMAL")
            conn.executescript(_SCHEMA)
            self._conn = conn
        return self._conn

    # --- blocking calls (run them in a worker thread: see the async wrappers below) ---
    def put_now(self, response: dict[str, Any], messages: list[dict[str, Any]]) -> None:
        """Insert or replace, then drop what is too old or past the count (oldest first)."""
        now = self._clock()
        with self._lock:
            db = self._db()
            db.execute("BEGIN")
            try:
                db.execute(
                    "INSERT INTO responses (id, stored_at, response, messages) VALUES (?, ?, ?, ?) "
                    "ON CONFLICT(id) DO UPDATE SET response = excluded.response, messages = excluded.messages",
                    (response["id"], now, json.dumps(response), json.dumps(messages)),
                )
                db.execute("DELETE FROM responses WHERE stored_at < ?", (now - self.max_age_s,))
                db.execute(
                    "DELETE FROM responses WHERE id IN (SELECT id FROM responses "
                    "ORDER BY stored_at DESC, rowid DESC LIMIT -1 OFFSET ?)",
                    (self.max_entries,),
                )
                db.execute("COMMIT")
            except BaseException:
                db.execute("ROLLBACK")
                raise

    def get_now(self, response_id: str) -> StoredResponse | None:
        with self._lock:
            row = (
                self._db()
                .execute(
                    "SELECT response, messages FROM responses WHERE id = ? AND stored_at >= ?",
                    (response_id, self._clock() - self.max_age_s),
                )
                .fetchone()
            )
        return None if row is None else StoredResponse(json.loads(row[0]), json.loads(row[1]))

    def delete_now(self, response_id: str) -> bool:
        with self._lock:
            cur = self._db().execute("DELETE FROM responses WHERE id = ?", (response_id,))
        return cur.rowcount > 0

    def count(self) -> int:
        with self._lock:
            return int(self._db().execute("SELECT COUNT(*) FROM responses").fetchone()[0])

    def close(self) -> None:
        with self._lock:
            if self._conn is not None:
                self._conn.close()
                self._conn = None

    # --- from the event loop ---
    async def put(self, response: dict[str, Any], messages: list[dict[str, Any]]) -> None:
        await asyncio.to_thread(self.put_now, response, messages)

    async def get(self, response_id: str) -> StoredResponse | None:
        return await asyncio.to_thread(self.get_now, response_id)

    async def delete(self, response_id: str) -> bool:
        return await asyncio.to_thread(self.delete_now, response_id)
