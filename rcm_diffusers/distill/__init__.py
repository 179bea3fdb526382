"""Distillation: rCM (sCM + DMD) and QAD training of a student over a frozen diffusers base.

Nothing here is needed to sample; ``import rcm_diffusers`` never imports this package (it pulls in accelerate
and peft). Modules, in the order data flows through a run:

- ``config``: ``RCMConfig`` / ``QADConfig`` (YAML + ``--key value``, validated, ``--help``)
- ``data``, ``prepare``: the precomputed-latent dataset format and the encoder that writes it
- ``adapters``, ``experts``: teacher / student / fake score as views of one frozen base; Wan 2.2's two experts
- ``losses``, ``alternation``, ``ema``: sCM, DMD and fake-score losses; the student / fake schedule; power EMA
- ``trainer``: one rCM iteration, metrics, export; ``qad``, ``qad_trainer``: the QAD objective and its steps
- ``checkpoints``, ``runs``, ``previews``: checkpoints with a manifest, the run folder rules, sample previews
- ``fsdp``, ``memory``: FSDP2 sharding of the base; the memory model of a training step
"""
