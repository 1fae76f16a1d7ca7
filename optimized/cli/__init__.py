"""The command line: one module per subcommand; `python -m optimized` dispatches (optimized/__main__.py)."""
