"""`python -m rocketkv_cli`: the same as the `rocketkv` command."""

from .cli import run

run()
