"""ComfyUI custom-node entry: lets a clone of this repository in ``ComfyUI/custom_nodes/`` load as a node pack.

ComfyUI-Manager and the Comfy Registry install the repository root as the custom-node folder; the
nodes themselves live in ``comfy_nodes/`` (see docs/comfyui.md). This file is not part of the
``rcm_diffusers`` Python package (setuptools ships ``rcm_diffusers*`` only).
"""

from .comfy_nodes import *  # noqa: F401,F403  (comfy_entrypoint, or NODE_CLASS_MAPPINGS on old ComfyUI)
from .comfy_nodes import __all__  # noqa: F401
