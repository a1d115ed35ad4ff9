"""``python -m fmoe`` (and ``torchrun -m fmoe``) runs the ``fmoe`` command."""

import sys

from fmoe.cli import main

sys.exit(main())
