"""The engine: prefill and compress documents (`engine.py`, `selectors.py`), answer from a
compressed cache (`answer.py`), long documents in segments (`segments.py`), reading documents
(`documents.py`), and the Python API (`api.py`). No argument parsing or printing."""
