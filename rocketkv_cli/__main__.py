"""`python -m rocketkv_cli`: the same as the `rocketkv` command."""

from .entry import main

main()
