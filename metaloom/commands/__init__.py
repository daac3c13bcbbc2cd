"""CLI subcommands, one module each; `metaloom.cli.COMMANDS` lists them."""
