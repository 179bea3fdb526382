"""Quantization-aware distillation from a clone:
``accelerate launch training/qad.py --config training/configs/<name>.yaml``.

Without ``--config`` it trains the embedded digits QAD example (training/configs/qad-digits.yaml). ``--help`` lists
every option; ``--verify RUN_DIR`` checks a finished run's exports. The trainer is
``rcm_diffusers.distill.QADTrainer`` (docs/qad.md); after ``pip install`` the same runs as
``accelerate launch -m rcm_diffusers.distill.qad_trainer``.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from rcm_diffusers.distill.qad_trainer import main  # noqa: E402

DEFAULT_CONFIG = os.path.join(os.path.dirname(os.path.abspath(__file__)), "configs", "qad-digits.yaml")

if __name__ == "__main__":
    main(default_config=DEFAULT_CONFIG)
