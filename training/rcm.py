"""rCM distillation from a clone:
``accelerate launch training/rcm.py --config training/configs/<name>.yaml [--key value ...]``.

Without ``--config`` it trains the embedded digits default (training/configs/digits.yaml). ``--help`` lists every
option; ``--verify RUN_DIR`` checks a finished run's exports. The trainer is ``rcm_diffusers.distill.RCMTrainer``
(docs/training.md); after ``pip install`` the same runs as ``accelerate launch -m rcm_diffusers.distill.rcm_trainer``.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from rcm_diffusers.distill.rcm_trainer import main  # noqa: E402

DEFAULT_CONFIG = os.path.join(os.path.dirname(os.path.abspath(__file__)), "configs", "digits.yaml")

if __name__ == "__main__":
    main(default_config=DEFAULT_CONFIG)
