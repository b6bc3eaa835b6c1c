import sys

from proxy.bench.cli import main

sys.exit(main(sys.argv[1:]))
