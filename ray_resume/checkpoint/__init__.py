"""Checkpointing, in rooms: `format/` (what is on disk), `io/` (the bytes moved), `interop/` (other
formats), and here the orchestration: a rank's save and restore, the commit, the fallback, the memory
tier, a checkpoint root and what a job resumes (docs/architecture.md)."""
