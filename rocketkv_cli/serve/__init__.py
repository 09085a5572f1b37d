"""`rocketkv serve`: a warm local server (models and caches kept loaded) and its thin client.

`client.py` and `config.py` are standard library only (the CLI imports them before torch, so a
command answered by a server never imports torch); `server.py`, `app.py`, `jobs.py` and `warm.py`
are the server (Starlette + uvicorn over the Python API). docs/serve.md describes the API and the
security model.
"""
