"""The `.kv` file format and ingest checkpoints: the only place where a compressed cache becomes
bytes and strings, and back (docs/file-format.md). Imports core, never model or engine."""
