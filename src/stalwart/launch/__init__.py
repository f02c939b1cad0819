"""Launcher pieces: the job master (HTTP+JSON over a SQLite journal) and its client."""
