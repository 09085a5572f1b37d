"""`rocketkv batch`: a manifest of documents and questions answered through the Python API, in
this process, in a local pool of processes, or on a Ray cluster (docs/batch.md). Above the API:
nothing below imports it."""
