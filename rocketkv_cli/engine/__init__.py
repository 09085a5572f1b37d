"""The compute layer: prefill and compress a document (`engine.py`, with the stage-1 methods of
`methods/`), one `decode_one_token` over static buffers (`decoder.py`), the one answer loop and
its stop rules (`answer.py`, `stopping.py`), the attention scores citations are built from
(`attribution.py`), and what the engine takes in (`inputs.py`). The answering service and the
Python API sit above it in `api/`. No argument parsing or printing."""
