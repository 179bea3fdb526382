"""ComfyUI checkouts for the tests in this folder, a ComfyUI server started on 127.0.0.1, tiny models.

``COMFYUI_PATH`` names one ComfyUI checkout, or several separated by ``os.pathsep`` (e.g. a
current one and one from before ``comfy_api.latest``). In-process tests import the first; the
server tests run once per checkout. The Python running pytest must have ComfyUI's requirements;
``COMFYUI_PYTHON`` (same order) may name another Python per checkout for its server.
Without ``COMFYUI_PATH`` these tests skip: ComfyUI is not on PyPI, so CI cannot install it.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
COMFYUI_PATHS = [p for p in os.environ.get("COMFYUI_PATH", "").split(os.pathsep) if p]
# the Python that runs each checkout's server (same order; default: the one running pytest), for
# checkouts that pin other versions of ComfyUI's frontend/template packages
COMFYUI_PYTHONS = [p for p in os.environ.get("COMFYUI_PYTHON", "").split(os.pathsep) if p]


def server_python(comfy_path: str) -> str:
    if comfy_path in COMFYUI_PATHS and COMFYUI_PATHS.index(comfy_path) < len(COMFYUI_PYTHONS):
        return COMFYUI_PYTHONS[COMFYUI_PATHS.index(comfy_path)]
    return sys.executable


SKIP_REASON = (
    "set COMFYUI_PATH to a ComfyUI checkout (several separated by os.pathsep) and run with a Python "
    "that has its requirements to run the ComfyUI tests; ComfyUI is not on PyPI, so CI skips them"
)


def have_comfyui() -> bool:
    return bool(COMFYUI_PATHS) and all(os.path.isfile(os.path.join(p, "nodes.py")) for p in COMFYUI_PATHS)


def has_comfy_api_latest(comfy_path: str) -> bool:
    return os.path.isdir(os.path.join(comfy_path, "comfy_api", "latest"))


def renoise_seed_offset(comfy_path: str) -> int:
    """1 where ComfyUI's ``default_noise_sampler`` seeds its CPU generator with ``seed + 1`` (2026), else 0 (2025)."""
    with open(os.path.join(comfy_path, "comfy", "k_diffusion", "sampling.py")) as f:
        src = f.read()
    body = src[src.index("def default_noise_sampler") :]
    body = body[: body.index("\ndef ", 1)]
    return 1 if "seed += 1" in body else 0


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# Stand-ins for the text encoder and the VAE encoder: a custom pack (legacy API, loads in every ComfyUI) whose
# RCMTestTextEmbeds returns CONDITIONING read from a safetensors file in ComfyUI's input folder. A real UMT5-XXL
# or T5/CLIP cannot be built tiny through ComfyUI's loaders (their configs are fixed), and the rCM
# nodes never look at the text path. ``RCMTestVAE`` returns a VAE whose ``encode`` gives fixed latents
# from a file (the only VAE call of ComfyUI's ``WanImageToVideo``), for the I2V workflows.
STANDIN_PACK = '''
import folder_paths
from safetensors.torch import load_file


class RCMTestTextEmbeds:
    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"file": ("STRING", {"default": "embeds.safetensors"})}}

    RETURN_TYPES = ("CONDITIONING",)
    FUNCTION = "run"
    CATEGORY = "testing"

    def run(self, file):
        return ([[load_file(folder_paths.get_annotated_filepath(file))["context"], {}]],)


class _FixedLatentVAE:
    """Duck-typed VAE for WanImageToVideo: ``encode(pixels)`` returns fixed Wan latents, whatever the pixels."""

    def __init__(self, latent):
        self.latent = latent
        self.encoded_shapes = []

    def encode(self, pixels):
        self.encoded_shapes.append(tuple(pixels.shape))
        return self.latent.clone()


class RCMTestVAE:
    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"file": ("STRING", {"default": "image_latent.safetensors"})}}

    RETURN_TYPES = ("VAE",)
    FUNCTION = "run"
    CATEGORY = "testing"

    def run(self, file):
        return (_FixedLatentVAE(load_file(folder_paths.get_annotated_filepath(file))["latent"]),)


NODE_CLASS_MAPPINGS = {"RCMTestTextEmbeds": RCMTestTextEmbeds, "RCMTestVAE": RCMTestVAE}
'''


class ComfyServer:
    """``main.py --cpu`` of one checkout, on a free port of 127.0.0.1, with its own base directory."""

    def __init__(self, comfy_path: str, base: str, startup_timeout: float = 300.0):
        self.comfy_path, self.base = comfy_path, base
        for sub in ("models/diffusion_models", "models/loras", "custom_nodes", "input", "output", "user", "temp"):
            os.makedirs(os.path.join(base, sub), exist_ok=True)
        # the install layout of ComfyUI-Manager / the Registry: the repository root is the custom-node folder
        os.symlink(REPO, os.path.join(base, "custom_nodes", "rcm-diffusers"))
        os.makedirs(os.path.join(base, "custom_nodes", "rcm_test_standins"))
        with open(os.path.join(base, "custom_nodes", "rcm_test_standins", "__init__.py"), "w") as f:
            f.write(STANDIN_PACK)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = os.path.join(base, "server.log")
        env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH",)}
        env.update(OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1")
        cmd = [
            server_python(comfy_path),
            "main.py",
            "--cpu",
            "--listen",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--base-directory",
            base,
            "--disable-auto-launch",
            "--disable-api-nodes",
        ]
        self._log = open(self.log_path, "w")
        self.proc = subprocess.Popen(cmd, cwd=comfy_path, env=env, stdout=self._log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + startup_timeout
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"ComfyUI exited with {self.proc.returncode} during start-up:\n{self.log()[-4000:]}")
            try:
                self.get("/system_stats", timeout=2)
                break
            except (urllib.error.URLError, ConnectionError, OSError):
                if time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError(f"ComfyUI did not answer within {startup_timeout:.0f} s:\n{self.log()[-4000:]}")
                time.sleep(1.0)

    def log(self) -> str:
        with open(self.log_path, errors="replace") as f:
            return f.read()

    def get(self, path: str, timeout: float = 30):
        with urllib.request.urlopen(self.url + path, timeout=timeout) as r:
            return json.loads(r.read())

    def post(self, path: str, payload: dict, timeout: float = 30) -> tuple[int, dict]:
        req = urllib.request.Request(
            self.url + path, data=json.dumps(payload).encode(), headers={"Content-Type": "application/json"}
        )
        try:
            with urllib.request.urlopen(req, timeout=timeout) as r:
                return r.status, json.loads(r.read())
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read() or b"{}")

    def run_prompt(self, prompt: dict, timeout: float = 300.0) -> dict:
        """POST ``prompt`` to /prompt, poll /history/<id> until it is done; returns the history entry."""
        status, body = self.post("/prompt", {"prompt": prompt, "client_id": "rcm-tests"})
        if status != 200:
            raise AssertionError(f"/prompt refused the workflow ({status}): {json.dumps(body)[:3000]}")
        prompt_id = body["prompt_id"]
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            hist = self.get(f"/history/{prompt_id}")
            if prompt_id in hist:  # a prompt enters the history once it has finished (or failed)
                return hist[prompt_id]
            if self.proc.poll() is not None:
                raise AssertionError(f"ComfyUI died while running the prompt:\n{self.log()[-4000:]}")
            time.sleep(0.5)
        raise AssertionError(f"prompt {prompt_id} did not finish within {timeout:.0f} s:\n{self.log()[-3000:]}")

    def stop(self):
        """Terminate the server by its PID (SIGTERM, then SIGKILL after 20 s)."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=20)
        self._log.close()


# ----------------------------------------------------------------------------- tiny Wan 2.1 T2V model

# dims multiple of 128 and text_dim 4096: ComfyUI's model detection takes it for Wan 2.1 T2V
DIM, FFN, LAYERS, TEXT_DIM = 128, 256, 2, 4096


def import_comfy(comfy_path: str | None = None):
    """Make the first (or given) ComfyUI checkout importable in this process, on the CPU."""
    path = comfy_path or COMFYUI_PATHS[0]
    if path not in sys.path:
        sys.path.insert(0, path)
    if REPO not in sys.path:
        sys.path.insert(0, REPO)
    from comfy.cli_args import args

    args.cpu = True


def tiny_wan_state_dict(seed: int = 0, in_dim: int = 16) -> dict:
    """Random tiny Wan 2.1 T2V weights in ComfyUI's (original) layout, ``model.diffusion_model.`` prefix.

    ``in_dim=36``: a Wan 2.2 I2V A14B-shaped expert (noise 16 + first-frame mask 4 + image latents 16 on the
    channels, no CLIP image branch); ComfyUI's model detection reads the input channels off the weights."""
    import torch

    import_comfy()
    import comfy.ops
    from comfy.ldm.wan.model import WanModel

    meta = WanModel(
        dim=DIM,
        ffn_dim=FFN,
        num_heads=DIM // 128,
        num_layers=LAYERS,
        text_dim=TEXT_DIM,
        in_dim=in_dim,
        out_dim=16,
        device="meta",
        operations=comfy.ops.disable_weight_init,
    )
    g = torch.Generator().manual_seed(seed)
    sd = {}
    for k, v in meta.state_dict().items():
        if "norm" in k and k.endswith("weight"):
            sd[k] = torch.ones(v.shape)
        else:
            sd[k] = 0.05 * torch.randn(v.shape, generator=g)
    return {f"model.diffusion_model.{k}": v for k, v in sd.items()}


def diffusers_wan_from_comfy(state_dict):
    """The same weights in diffusers' ``WanTransformer3DModel`` (converted by diffusers' own single-file converter)."""
    from diffusers import WanTransformer3DModel
    from diffusers.loaders.single_file_utils import convert_wan_transformer_to_diffusers

    in_dim = next(v.shape[1] for k, v in state_dict.items() if k.endswith("patch_embedding.weight"))
    model = WanTransformer3DModel(
        patch_size=(1, 2, 2),
        num_attention_heads=DIM // 128,
        attention_head_dim=128,
        in_channels=in_dim,
        out_channels=16,
        text_dim=TEXT_DIM,
        freq_dim=256,
        ffn_dim=FFN,
        num_layers=LAYERS,
        cross_attn_norm=True,
        qk_norm="rms_norm_across_heads",
        eps=1e-6,
    )
    converted = convert_wan_transformer_to_diffusers(dict(state_dict))
    model.load_state_dict(converted, strict=True)
    return model.eval()


def wan_latent_stats():
    """Wan 2.1's latent mean/std (ComfyUI's ``latent_formats.Wan21`` = diffusers ``AutoencoderKLWan`` defaults)."""
    import inspect

    import torch
    from diffusers import AutoencoderKLWan

    params = inspect.signature(AutoencoderKLWan.__init__).parameters
    mean = torch.tensor(params["latents_mean"].default).view(1, 16, 1, 1, 1)
    std = torch.tensor(params["latents_std"].default).view(1, 16, 1, 1, 1)
    return mean, std
