"""`python -m gpuwarden.agent.cli`: the command, as the console script runs it."""
from gpuwarden.agent.cli.command import console
from gpuwarden.agent.cli.main import main

console(main)
