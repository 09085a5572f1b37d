"""`python -m rocketkv_cli.cli`: the same as the `rocketkv` command (`entry.main`: the signal
handling first, then this package)."""

from ..entry import main

main()
