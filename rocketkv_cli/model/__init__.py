"""Everything coupled to transformers: loading models (presets, GGUF, directories, cached hub ids),
the cache layer and attention function rocketkv plugs in through transformers' public seams
(`hf.py`), and prompt templates. No other sub-package imports transformers."""
