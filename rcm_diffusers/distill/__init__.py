"""Distillation: rCM (sCM + DMD) and QAD training of a student over a frozen diffusers base.

Nothing here is needed to sample; ``import rcm_diffusers`` never imports this package (it pulls in accelerate
and peft). ``RCMTrainer(RCMConfig.from_yaml(path, **overrides)).train()`` runs a distillation from Python;
docs/ARCHITECTURE.md lists the modules.
"""

__all__ = ["RCMConfig", "QADConfig", "RCMTrainer", "QADTrainer"]


def __getattr__(name):  # the trainers import accelerate and peft: only when asked for
    if name in ("RCMConfig", "QADConfig"):
        from . import config

        return getattr(config, name)
    if name == "RCMTrainer":
        from .rcm_trainer import RCMTrainer

        return RCMTrainer
    if name == "QADTrainer":
        from .qad_trainer import QADTrainer

        return QADTrainer
    raise AttributeError(name)
