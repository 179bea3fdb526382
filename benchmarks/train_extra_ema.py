"""Train with ``training/rcm.py`` and keep extra power EMAs of the student beside the configured one (docs/screens.md,
EMA rate).

    python benchmarks/train_extra_ema.py 0.05,0.2 -- --config training/configs/digits.yaml --output_dir RUN

The EMA changes nothing in training (it only reads the student's weights after each student step), so one run
yields every rate: the configured ``--ema_rate`` is exported to ``RUN/ema/`` as usual, each extra rate ``s`` to
``RUN/ema-<s>/`` with the same ``save_student_lora``. One process only, no resume (the extra shadows are not
checkpointed); ``benchmarks/digits_sweep.py --extra_ema`` calls this and evaluates every ``ema*`` folder.
"""

from __future__ import annotations

import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from rcm_diffusers.distill import export as T  # noqa: E402
from rcm_diffusers.distill import rcm_trainer as rcm  # noqa: E402
from rcm_diffusers.distill.ema import PowerEMA  # noqa: E402


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    if len(argv) < 2 or argv[1] != "--":
        raise SystemExit(__doc__)
    rates = [float(s) for s in argv[0].split(",") if s]
    if "--resume" in argv:
        raise SystemExit("train_extra_ema: the extra EMAs are not checkpointed; run without --resume")
    extras = {}

    class ExtraEMA(PowerEMA):
        """The configured EMA; every update also blends the same weights into one shadow per extra rate."""

        def __init__(self, named_params, s=0.10):
            super().__init__(named_params, s)
            extras.update({r: PowerEMA(named_params, s=r) for r in rates})

        def update(self, named_params, i):
            for e in extras.values():
                e.update(named_params, i)
            return super().update(named_params, i)

    export = T.export_student

    def export_with_extras(pipeline_cls, cfg, base, ema):
        export(pipeline_cls, cfg, base, ema)
        for r, e in extras.items():
            T.save_student_lora(
                pipeline_cls,
                os.path.join(cfg.output_dir, f"ema-{r:g}"),
                base,
                base.peft_config["student"],
                weights=e.shadow,
            )

    rcm.PowerEMA, T.export_student = ExtraEMA, export_with_extras
    rcm.main(argv[2:], default_config=os.path.join(REPO, "training", "configs", "digits.yaml"))


if __name__ == "__main__":
    main()
