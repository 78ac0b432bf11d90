"""``python -m bench.gpu``: see :mod:`bench.gpu.run`."""

import sys

from bench.gpu.run import main

sys.exit(main())
