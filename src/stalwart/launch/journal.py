"""The job master's durable state in SQLite: membership, progress, incidents and decisions.

Everything the master knows lives here, written before it answers, so a killed and restarted master
reopens the same file and carries on without the workers noticing. WAL mode keeps readers (status,
dashboard) from blocking the heartbeat writers.
"""

from __future__ import annotations

import json
import sqlite3
import threading
import time
from pathlib import Path
from typing import Any

SCHEMA = """
CREATE TABLE IF NOT EXISTS job (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS nodes (
    node_id TEXT PRIMARY KEY, host TEXT, nproc INTEGER, state TEXT NOT NULL,
    joined REAL NOT NULL, last_heartbeat REAL NOT NULL, progress TEXT NOT NULL DEFAULT '{}',
    info TEXT NOT NULL DEFAULT '{}');
CREATE TABLE IF NOT EXISTS incidents (
    id INTEGER PRIMARY KEY AUTOINCREMENT, node_id TEXT, kind TEXT NOT NULL, class TEXT,
    fault REAL, detected REAL, stopped REAL, restarted REAL, first_step REAL,
    details TEXT NOT NULL DEFAULT '{}');
CREATE TABLE IF NOT EXISTS decisions (
    id INTEGER PRIMARY KEY AUTOINCREMENT, ts REAL NOT NULL, action TEXT NOT NULL,
    reason TEXT NOT NULL, details TEXT NOT NULL DEFAULT '{}');
CREATE TABLE IF NOT EXISTS chaos (
    id INTEGER PRIMARY KEY AUTOINCREMENT, ts REAL NOT NULL, spec TEXT NOT NULL);
"""

INCIDENT_TIMES = ("fault", "detected", "stopped", "restarted", "first_step")
SET_KEY = "INSERT INTO job(key, value) VALUES(?, ?) ON CONFLICT(key) DO UPDATE SET value = excluded.value"
DECIDE = "INSERT INTO decisions(ts, action, reason, details) VALUES(?, ?, ?, ?)"


class Journal:
    """Thread-safe wrapper: the HTTP server handles requests on several threads."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self._db = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None)
        self._db.row_factory = sqlite3.Row
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=NORMAL")
        self._db.executescript(SCHEMA)

    def close(self) -> None:
        with self._lock:
            self._db.close()

    def _write(self, sql: str, params: tuple = ()) -> sqlite3.Cursor:
        with self._lock:
            return self._db.execute(sql, params)

    def _read(self, sql: str, params: tuple = ()) -> list[dict[str, Any]]:
        with self._lock:
            return [dict(row) for row in self._db.execute(sql, params).fetchall()]

    # -- job-level key/values (created time, restart budget used, ...) ------------------------
    def get(self, key: str, default: Any = None) -> Any:
        rows = self._read("SELECT value FROM job WHERE key = ?", (key,))
        return json.loads(rows[0]["value"]) if rows else default

    def set(self, key: str, value: Any) -> None:
        self._write(SET_KEY, (key, json.dumps(value)))

    def increment(self, key: str) -> int:
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            row = self._db.execute("SELECT value FROM job WHERE key = ?", (key,)).fetchone()
            value = (json.loads(row["value"]) if row else 0) + 1
            self._db.execute(SET_KEY, (key, json.dumps(value)))
            self._db.execute("COMMIT")
            return value

    # -- membership -----------------------------------------------------------------------------
    def join(self, node_id: str, host: str, nproc: int, info: dict[str, Any]) -> None:
        now = time.time()
        self._write(
            "INSERT INTO nodes(node_id, host, nproc, state, joined, last_heartbeat, info) "
            "VALUES(?, ?, ?, 'alive', ?, ?, ?) ON CONFLICT(node_id) DO UPDATE SET host = excluded.host, "
            "nproc = excluded.nproc, state = 'alive', last_heartbeat = excluded.last_heartbeat, "
            "info = excluded.info",
            (node_id, host, nproc, now, now, json.dumps(info)),
        )

    def heartbeat(self, node_id: str, progress: dict[str, Any], info: dict[str, Any] | None = None) -> bool:
        """Record a heartbeat; False when the node is unknown (it must join first)."""
        cur = self._write(
            "UPDATE nodes SET last_heartbeat = ?, progress = ?, info = COALESCE(?, info), "
            "state = CASE WHEN state = 'lost' THEN 'alive' ELSE state END WHERE node_id = ?",
            (time.time(), json.dumps(progress), json.dumps(info) if info is not None else None, node_id),
        )
        return cur.rowcount == 1

    def mark_lost(self, node_id: str, when: float, reason: str, silent_since: float | None = None) -> bool:
        """Mark an alive node lost, with ``lost_at.<node>`` and a ``node_lost`` decision, in one
        transaction: whoever sees the state sees when and why (a reader between the writes once did
        not). ``silent_since``: only if its last heartbeat is older (a beat may have just come).
        False when the node is unknown, not alive, or beat since."""
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                row = self._db.execute(
                    "SELECT state, last_heartbeat FROM nodes WHERE node_id = ?", (node_id,)
                ).fetchone()
                if row is None or row["state"] != "alive" or (silent_since and row["last_heartbeat"] >= silent_since):
                    self._db.execute("ROLLBACK")
                    return False
                self._db.execute(SET_KEY, (f"lost_at.{node_id}", json.dumps(when)))
                self._db.execute(DECIDE, (when, "node_lost", reason, json.dumps({"node_id": node_id})))
                self._db.execute("UPDATE nodes SET state = 'lost' WHERE node_id = ?", (node_id,))
                self._db.execute("COMMIT")
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
            return True

    def set_node_state(self, node_id: str, state: str) -> None:
        self._write("UPDATE nodes SET state = ? WHERE node_id = ?", (state, node_id))

    def node_count(self) -> int:
        """How many nodes joined (cheap: no rows decoded; a join asks it to scale heartbeats)."""
        return int(self._read("SELECT COUNT(*) AS n FROM nodes")[0]["n"])

    def nodes(self) -> list[dict[str, Any]]:
        rows = self._read("SELECT * FROM nodes ORDER BY node_id")
        for row in rows:
            row["progress"] = json.loads(row["progress"])
            row["info"] = json.loads(row["info"])
        return rows

    # -- incidents and decisions ----------------------------------------------------------------
    def open_incident(
        self, node_id: str | None, kind: str, cls: str | None, times: dict[str, float], details: dict[str, Any]
    ) -> int:
        unknown = set(times) - set(INCIDENT_TIMES)
        if unknown:
            raise ValueError(f"unknown incident timestamps {sorted(unknown)}; use {INCIDENT_TIMES}")
        cols = ", ".join(["node_id", "kind", "class", "details", *times])
        marks = ", ".join("?" * (4 + len(times)))
        cur = self._write(
            f"INSERT INTO incidents({cols}) VALUES({marks})", (node_id, kind, cls, json.dumps(details), *times.values())
        )
        return int(cur.lastrowid)

    def update_incident(self, incident_id: int, times: dict[str, float], details: dict[str, Any] | None = None) -> bool:
        unknown = set(times) - set(INCIDENT_TIMES)
        if unknown:
            raise ValueError(f"unknown incident timestamps {sorted(unknown)}; use {INCIDENT_TIMES}")
        sets = [f"{k} = ?" for k in times]
        params: list[Any] = list(times.values())
        if details is not None:
            sets.append("details = json_patch(details, ?)")
            params.append(json.dumps(details))
        if not sets:
            return True
        cur = self._write(f"UPDATE incidents SET {', '.join(sets)} WHERE id = ?", (*params, incident_id))
        return cur.rowcount == 1

    def incidents(self) -> list[dict[str, Any]]:
        rows = self._read("SELECT * FROM incidents ORDER BY id")
        for row in rows:
            row["details"] = json.loads(row["details"])
        return rows

    def decide(self, action: str, reason: str, details: dict[str, Any] | None = None) -> int:
        cur = self._write(DECIDE, (time.time(), action, reason, json.dumps(details or {})))
        return int(cur.lastrowid)

    def decisions(self) -> list[dict[str, Any]]:
        rows = self._read("SELECT * FROM decisions ORDER BY id")
        for row in rows:
            row["details"] = json.loads(row["details"])
        return rows

    # -- fault injection into the running job (`stalwart chaos`) --------------------------------
    def add_chaos(self, spec: str) -> int:
        cur = self._write("INSERT INTO chaos(ts, spec) VALUES(?, ?)", (time.time(), spec))
        return int(cur.lastrowid)

    def chaos_after(self, after_id: int) -> list[dict[str, Any]]:
        """Specs newer than `after_id`: agents remember the last id they applied, so a restarted
        master (or agent) delivers each spec again at most to agents that have not seen it."""
        return self._read("SELECT id, ts, spec FROM chaos WHERE id > ? ORDER BY id", (after_id,))
