"""Checkpoint format: layout (names), storage (I/O), schema (JSON), plan, writer, reader, commit."""
