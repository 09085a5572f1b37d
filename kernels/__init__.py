"""Triton kernels for rocketkv's hot paths (SPEC §5), installed as `rocketkv_cli.kernels`.

None is implemented yet: every op runs its torch reference (`rocketkv_cli.prefill`,
`rocketkv_cli.decode`) on every device. The kernels are tracked in the issue "Triton kernels for
the decode and scoring hot paths"; each will live in its own file here with a launcher of the same
signature as its reference, dispatched by `rocketkv_cli.ops`.
"""
