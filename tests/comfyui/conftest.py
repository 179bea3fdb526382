"""Fixtures of the ComfyUI tests; the machinery is in ``comfyui_harness.py`` (see there for COMFYUI_PATH)."""

import os
import shutil

import pytest
from comfyui_harness import COMFYUI_PATHS, SKIP_REASON, ComfyServer, have_comfyui


@pytest.fixture(
    scope="module",
    params=COMFYUI_PATHS or [None],
    ids=lambda p: "no-comfyui" if p is None else os.path.basename(os.path.normpath(p)),
)
def comfy_server(request, tmp_path_factory):
    if request.param is None or not have_comfyui():
        pytest.skip(SKIP_REASON)
    base = str(tmp_path_factory.mktemp("comfy_base"))
    server = ComfyServer(request.param, base)
    try:
        yield server
    finally:
        server.stop()
        if os.environ.get("RCM_KEEP_COMFY_LOG"):
            shutil.copy(server.log_path, os.environ["RCM_KEEP_COMFY_LOG"])
