"""python -m examples.train: train one arm (docs/TRAINING.md); --help lists the options."""

import sys

from .train import main

sys.exit(main())
