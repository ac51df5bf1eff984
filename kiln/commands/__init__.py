"""The kiln command line: the only package that parses argv, prints, and maps errors to exit codes.

Each command module exposes ``register(subparsers)``, which adds its parser(s) and sets
``run=<function(args, out: Output) -> int>`` as the parser default.
"""
