"""`python -m rocketkv_cli.cli`: the same as the `rocketkv` command."""

from . import run

run()
