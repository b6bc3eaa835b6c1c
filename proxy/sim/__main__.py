"""`python -m proxy.sim`: the same as `tokenprobe sim`."""

import sys

from proxy.sim.cli import main

sys.exit(main())
