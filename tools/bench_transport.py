#!/usr/bin/env python3
"""Transport benchmark: raw TCP vs coap+tcp vs coap (UDP), large-message strategies, codecs.

Usage: python tools/bench_transport.py [--json] [--sizes 4KiB,4MiB] [--udp-max 1MiB] [--repeat 0.5]
(the same as ``edgert bench transport``; the implementation is edgert.bench.transport).
"""

import sys

from edgert.bench.transport import main

if __name__ == "__main__":
    sys.exit(main())
