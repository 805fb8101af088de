"""Checkpoint format: paths (names), storage (I/O), schema (JSON), plan, writer, reader, loader, commit, lease."""
