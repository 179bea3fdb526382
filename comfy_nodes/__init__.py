"""rCM few-step sampling for ComfyUI: RCMSigmas, RCMSampler, TrigFlowTeacherSigmas, RCMLoraLoader, RCMExpertSplit.

Install: clone the repository into ``ComfyUI/custom_nodes/`` (the root ``__init__.py`` loads this
folder) or install it from the Comfy Registry / ComfyUI-Manager; see docs/comfyui.md.

ComfyUI with ``comfy_api.latest`` (2025-07 on) gets the nodes through ``comfy_entrypoint``;
older ComfyUI through ``NODE_CLASS_MAPPINGS``. Only one of the two is exported, since ComfyUI
takes the legacy mapping whenever a module has it.
"""

import importlib.util
import os
import sys


def _ensure_rcm_diffusers():
    """Use the ``rcm_diffusers`` folder of this checkout (same version as the nodes), else an installed one."""
    if "rcm_diffusers" in sys.modules:
        return
    repo = os.path.dirname(os.path.dirname(os.path.realpath(__file__)))
    init = os.path.join(repo, "rcm_diffusers", "__init__.py")
    if os.path.isfile(init):
        spec = importlib.util.spec_from_file_location(
            "rcm_diffusers", init, submodule_search_locations=[os.path.dirname(init)]
        )
        module = importlib.util.module_from_spec(spec)
        sys.modules["rcm_diffusers"] = module
        try:
            spec.loader.exec_module(module)
        except BaseException:
            del sys.modules["rcm_diffusers"]
            raise
        return
    try:
        import rcm_diffusers  # noqa: F401
    except ImportError as e:
        raise ImportError(
            "rCM nodes: the rcm_diffusers package is missing. Clone the whole rcm-diffusers repository into "
            "ComfyUI/custom_nodes/, or run `pip install rcm-diffusers` with ComfyUI's Python."
        ) from e


_ensure_rcm_diffusers()

from .nodes import NODES  # noqa: E402
from .schema import legacy_nodes, v3_nodes  # noqa: E402

try:
    from comfy_api.latest import ComfyExtension
except ImportError:  # ComfyUI before comfy_api.latest: the legacy mapping only
    ComfyExtension = None

if ComfyExtension is not None:

    class RCMExtension(ComfyExtension):
        async def get_node_list(self) -> list[type]:
            return v3_nodes(NODES)

    async def comfy_entrypoint() -> RCMExtension:
        return RCMExtension()

    __all__ = ["comfy_entrypoint"]
else:
    NODE_CLASS_MAPPINGS, NODE_DISPLAY_NAME_MAPPINGS = legacy_nodes(NODES)
    __all__ = ["NODE_CLASS_MAPPINGS", "NODE_DISPLAY_NAME_MAPPINGS"]
