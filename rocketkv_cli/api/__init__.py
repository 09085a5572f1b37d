"""The answering service and the Python API, above the engine: `RocketKV` (`rocketkv.py`), its
checks made before a model loads (`checks.py`, and the standard-library ones in `preflight.py`),
a `.kv` file read or described without transformers (`files.py`),
sessions and streamed answers (`session.py`), segmented caches (`segments.py`: ingest, routing,
merged answers), summaries that are never degenerate (`summaries.py`, with the standard-library
check `summary_check.py`), citations (`citations.py`), reading documents (`documents.py`), thread
counts (`threads.py`) and stored models (`home.py`).

Nothing is imported here, so that `preflight`, `documents`, `threads` and `summary_check` stay
importable without torch.
"""
