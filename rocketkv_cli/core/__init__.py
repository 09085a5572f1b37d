"""The algorithm core: budgets, stage 1 (SnapKV++), stage 2 (hybrid sparse attention), exact
attention by RoPE positions, and the typed compressed cache. Pure torch: no transformers, no
triton, no safetensors, no environment or CLI. These torch functions are the specification the
kernels in `rocketkv_cli.kernels` must match (docs/algorithm.md)."""
