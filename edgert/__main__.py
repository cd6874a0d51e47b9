"""``python -m edgert``: the same command line as ``edgert``."""

from edgert.cli import main

main()
