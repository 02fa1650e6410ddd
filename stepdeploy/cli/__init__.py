"""The Typer command-line interface: thin wrappers that parse options and call the package."""
