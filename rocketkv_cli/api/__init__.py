"""The answering service and the Python API, above the engine: `RocketKV` (`rocketkv.py`), its
checks made before a model loads (`checks.py`), sessions and streamed answers (`session.py`),
segmented caches (`segments.py`: ingest, routing, summaries) and summaries that are never
degenerate (`summaries.py`, with the standard-library check `summary_check.py`).

Nothing is imported here, so that `summary_check` stays importable without torch.
"""
