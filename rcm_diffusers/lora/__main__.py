"""``python -m rcm_diffusers.lora``: the ``rcm-lora`` command line."""

import sys

from .cli import main

sys.exit(main())
