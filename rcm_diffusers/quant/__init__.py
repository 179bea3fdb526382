"""Low-bit weights for ComfyUI (docs/math.md §7): formats with a straight-through gradient (``formats``),
the Linear swap over a diffusers transformer (``modules``) and the ComfyUI-loadable export (``export``).
The QAD objective and trainer that use them live in ``rcm_diffusers.distill`` (``qad``, ``qad_trainer``)."""
