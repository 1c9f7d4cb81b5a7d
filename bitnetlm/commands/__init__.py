"""CLI commands: each module has add_arguments(parser) and run(args) -> int, and wraps a library function."""
