"""``python -m mars.cli VERB ...`` (how ``accelerate launch`` and ``torchrun`` start ``mars train``)."""

import sys

from mars.cli import main

sys.exit(main())
