"""The `agentrt` command group; the command modules attach themselves to it."""

from __future__ import annotations

import click

from agentrt.cli.options import AgentrtGroup


@click.group(cls=AgentrtGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="agentrt")
def main() -> None:
    """agentrt: fast tool-calling agents on Mixture-of-Experts models that do not fit in one GPU."""
