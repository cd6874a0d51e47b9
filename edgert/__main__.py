"""``python -m edgert``: the same command line as ``edgert``."""

from edgert.cli import main

if __name__ == "__main__":  # not when a spawned process (multiprocessing) re-imports it as __mp_main__
    main()
