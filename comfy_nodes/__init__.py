"""rCM few-step sampling for ComfyUI: RCMSigmas, RCMSampler, TrigFlowTeacherSigmas, RCMLoraLoader, RCMExpertSplit.

Drop (symlink or copy) this folder into ``ComfyUI/custom_nodes/`` and ``pip install rcm-diffusers``
into ComfyUI's Python; see docs/comfyui.md. Nodes use the new schema (``comfy_api``), loaded
through ``comfy_entrypoint``.
"""

import os
import sys

try:
    import rcm_diffusers  # noqa: F401
except ImportError:  # a symlinked checkout of the repository: use the package beside this folder
    _repo = os.path.dirname(os.path.dirname(os.path.realpath(__file__)))
    if not os.path.isdir(os.path.join(_repo, "rcm_diffusers")):
        raise ImportError("rcm_diffusers is not installed: run `pip install rcm-diffusers` with ComfyUI's Python.")
    sys.path.insert(0, _repo)

from comfy_api.latest import ComfyExtension, io  # noqa: E402

from .nodes import NODES  # noqa: E402


class RCMExtension(ComfyExtension):
    async def get_node_list(self) -> list[type[io.ComfyNode]]:
        return list(NODES)


async def comfy_entrypoint() -> RCMExtension:
    return RCMExtension()
