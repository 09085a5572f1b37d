"""Triton kernels for rocketkv's hot paths (docs/algorithm.md §6), installed as `rocketkv_cli.kernels`.

One op family per file, each a private `@triton.jit` kernel (or two) plus a host launcher
`<op>_triton(...)` with the same signature, layout and return as its torch reference:

- `page_summaries`: page min/max build at ingest and update on append (`decode.page_summaries`);
- `page_scores`: stage-2 approximate page scores on the chosen dims (`decode.page_scores`);
- `sparse_attention`: decode attention over the selected tokens (`decode.sparse_attention`);
- `observation_scores`: stage-1 window scoring and pooling (`prefill.observation_scores`, `pool_scores`).

Nothing here is imported unless `rocketkv_cli.ops` chooses the Triton backend (this package's
`__init__` imports no triton, so the torch path works without it installed).
"""
