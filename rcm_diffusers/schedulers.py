"""diffusers schedulers: the few-step rCM sampler and the TrigFlow-wrapped teacher ODE solvers (docs/math.md §2).

All three are ordinary ``SchedulerMixin``/``ConfigMixin`` schedulers that run unchanged in
``WanPipeline``, ``WanImageToVideoPipeline`` (incl. Wan 2.2 ``boundary_ratio``) and ``FluxPipeline``:

    pipe.scheduler = RCMScheduler.from_config(pipe.scheduler.config)
    video = pipe(prompt, num_inference_steps=4, guidance_scale=1.0).frames[0]

Conventions shared by the three:
- ``sigmas`` are RF times ``r`` in [0, 1] (diffusers' flow-matching sigmas); the update runs on the exact
  float64 ``r``. ``timesteps`` are what the pipeline hands the transformer: ``r * num_train_timesteps``,
  for ``RCMScheduler(time_input="bf16")`` (default) rounded to bfloat16 as the official rCM sampler feeds it.
- ``set_timesteps(sigmas=[...])`` takes *explicit RF times*, used as given (no shift); a final 0 is appended.
  ``set_timesteps(timesteps=[...])`` likewise, divided by ``num_train_timesteps``. Many pipelines always pass
  times; their default grid (``linspace(1, 1/n, n)`` in float64 or float32, ``linspace(1, 0, n+1)[:-1]``,
  CogView4's ``linspace(1000, 1, n)`` and GLM-Image's ``linspace(1000, 1, n+1)[:-1]`` timesteps with their sigmas)
  is read as ``num_inference_steps=n``.
- Config keys: our own EDM-scale limits are stored as ``rcm_sigma_max`` / ``teacher_sigma_max`` /
  ``teacher_sigma_min`` (``sigma_max=`` / ``sigma_min=`` are accepted as arguments), because stock
  schedulers read ``sigma_max`` / ``sigma_min`` from any config they are built from. Every key of a stock
  config that we do not use (``use_karras_sigmas``, UniPC's ``sigma_max: null``, ...) is carried along
  unchanged, so ``Ours.from_config(stock.config)`` and back is lossless.
"""

from __future__ import annotations

import hashlib
import logging
import math
import os
import warnings
from dataclasses import dataclass

import numpy as np
import torch
from diffusers.configuration_utils import ConfigMixin, register_to_config
from diffusers.schedulers import UniPCMultistepScheduler
from diffusers.schedulers.scheduling_utils import SchedulerMixin
from diffusers.utils import BaseOutput
from diffusers.utils.torch_utils import randn_tensor

from .models import TIME_INPUTS
from .sampling import (
    DEFAULT_MID_T,
    SPACINGS,
    mid_t_as_config,
    parse_mid_t,
    rcm_rf_times,
    rcm_update,
    teacher_rf_grid,
    validate_mid_t,
    validate_rf_times,
)

__all__ = ["RCMScheduler", "TrigFlowEulerScheduler", "TrigFlowUniPCScheduler", "RCMSchedulerOutput"]

logger = logging.getLogger(__name__)


@dataclass
class RCMSchedulerOutput(BaseOutput):
    """``prev_sample``: the latents at the next time; ``pred_original_sample``: the step's ``x0``."""

    prev_sample: torch.Tensor
    pred_original_sample: torch.Tensor | None = None


def _check_finite_positive(name: str, value: float) -> None:
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name} must be a finite number > 0, got {value!r}.")


_OUR_CLASSES = ("RCMScheduler", "TrigFlowEulerScheduler", "TrigFlowUniPCScheduler")


#: How far a pipeline's default grid may lie from the exact ``k / n``: pipelines build it with ``np.linspace``
#: (float64) or ``torch.linspace`` (float32, also as ``.tolist()``), as ``linspace(1, 1/n, n)`` or
#: ``linspace(1, 0, n+1)[:-1]``; float32 values in (0, 1] are within a few ulps (2**-24 each) of ``k / n``
#: (measured <= 6e-8 for n <= 64), float64 within 1e-16. A grid meant as explicit times differs by far more.
DEFAULT_GRID_ATOL = 1e-6


def _as_float64(values) -> np.ndarray | None:
    if values is None:
        return None
    if isinstance(values, torch.Tensor):
        return values.detach().to("cpu", torch.float64).reshape(-1).numpy()
    try:
        return np.asarray(values, dtype=np.float64).reshape(-1)
    except (TypeError, ValueError):
        return None  # validate_rf_times reports it


def _default_grid_steps(r: np.ndarray | None, num_train_timesteps: float) -> int | None:
    """``n`` when the RF times ``r`` are a pipeline's own ``n``-step default grid (what it passes when the user gave
    no times), else ``None``. Three forms, each with an optional final 0, to float32 round-off (``DEFAULT_GRID_ATOL``):

    - ``1, (n-1)/n, ..., 1/n``: ``np.linspace(1, 1/n, n)`` (FLUX.1, FLUX.2, Qwen-Image, Chroma, LTX-2, ...),
      ``np.linspace(1, 0, n+1)[:-1]`` (HunyuanVideo-1.5), float32 ``torch.linspace(1, 1/n, n).tolist()`` (Z-Image);
    - ``linspace(T, 1, n) / T`` with ``T = num_train_timesteps``, each ``T r`` possibly cut to a whole number
      (CogView4's timesteps and sigmas);
    - ``linspace(T, 1, n+1)[:-1] / T``, each ``T r`` cut to a whole number or not (GLM-Image's timesteps and sigmas)."""
    if r is None or r.size == 0 or not np.all(np.isfinite(r)):
        return None
    if r.size > 1 and r[-1] == 0.0:
        r = r[:-1]
    n = r.size
    k = np.arange(n, dtype=np.float64)
    if np.all(np.abs(r - (n - k) / n) <= DEFAULT_GRID_ATOL):
        return n
    T = float(num_train_timesteps)
    if n > 1 and T > 1 and np.all(np.abs(r - (T - k * (T - 1) / (n - 1)) / T) <= 1 / T + DEFAULT_GRID_ATOL):
        return n
    # GLM-Image: linspace(T, 1, n+1)[:-1] cut to whole numbers, over T; matched exactly (to float32 round-off), as the
    # tolerance of the form above would also take explicit times such as (1, 0.501)
    if T > 1:
        exact = T - k * (T - 1) / n
        tr = r * T
        tol = DEFAULT_GRID_ATOL * T
        if np.all((np.abs(tr - np.floor(exact)) <= tol) | (np.abs(tr - exact) <= tol)):
            return n
    return None


class _FlowTimesMixin:
    """Step-index bookkeeping, explicit-grid parsing and stock-config compatibility shared by the schedulers
    of this module."""

    order = 1
    _rf: np.ndarray | None = None
    _explicit_pending: bool = False
    _flux_default_steps: int | None = None
    #: argument name -> config key (our EDM limits live under their own keys, see the module docstring)
    _aliases: dict = {}

    @classmethod
    def from_config(cls, config=None, return_unused_kwargs=False, **kwargs):
        """diffusers' ``from_config``; also takes ``sigma_max=`` (and teachers' ``sigma_min=``) for our own keys and
        reads configs written by earlier versions of this package. Stock keys pass through unchanged."""
        cfg = dict(config) if config is not None and not isinstance(config, str) else config
        if isinstance(cfg, dict):
            if cfg.get("_class_name") in _OUR_CLASSES:
                cfg.pop("use_flow_sigmas", None)  # written by versions <= 0.1; FluxPipeline must pass its sigmas
                if cfg.get("_class_name") == cls.__name__:
                    for alias, key in cls._aliases.items():
                        if alias in cfg and key not in cfg:
                            cfg[key] = cfg.pop(alias)
        for alias, key in cls._aliases.items():
            if alias in kwargs:
                if key in kwargs:
                    raise ValueError(f"pass either {alias}= or {key}=, not both.")
                kwargs[key] = kwargs.pop(alias)
        return super().from_config(cfg, return_unused_kwargs, **kwargs)

    @classmethod
    def _get_compatibles(cls):
        """Our three schedulers and diffusers' flow-matching schedulers (each takes the others' configs)."""
        import diffusers

        names = ["FlowMatchEulerDiscreteScheduler", "UniPCMultistepScheduler", "FlowMatchHeunDiscreteScheduler"]
        stock = [getattr(diffusers, n) for n in names if hasattr(diffusers, n)]
        return [globals()[n] for n in _OUR_CLASSES] + stock

    def _explicit_rf(self, num_inference_steps, sigmas, timesteps) -> np.ndarray | None:
        """Parse ``sigmas`` / ``timesteps`` given by a caller into float64 RF times ending at 0.

        A pipeline's own default grid (:func:`_default_grid_steps`, passed when the user gave no times) returns
        ``None`` and sets ``self._flux_default_steps = n``. Both ``sigmas`` and ``timesteps``
        (CogView4 always passes both): the ``sigmas`` are the RF times; the ``timesteps`` must be a default grid
        (then they are ignored) or ``sigmas * num_train_timesteps`` to within 1 (CogView4 cuts them to whole
        numbers)."""
        self._flux_default_steps = None
        if sigmas is None and timesteps is None:
            return None
        T = self.config.num_train_timesteps
        s, t = _as_float64(sigmas), _as_float64(timesteps)
        if sigmas is not None and timesteps is not None:
            t_default = t is not None and _default_grid_steps(t / T, T) is not None
            if s is None or t is None or not (t_default or (s.size == t.size and np.all(np.abs(t - s * T) <= 1.0))):
                raise ValueError(
                    f"sigmas (RF times) and timesteps disagree: timesteps must be sigmas x num_train_timesteps ({T}); "
                    "pass one of them."
                )
            timesteps = None
        n = _default_grid_steps(s if sigmas is not None else (None if t is None else t / T), T)
        if n is not None and num_inference_steps in (None, n):
            self._flux_default_steps = n
            return None
        if sigmas is not None:
            r = validate_rf_times(_to_list(sigmas), name="sigmas")
        else:
            r = validate_rf_times(np.asarray(_to_list(timesteps), dtype=np.float64) / T, name="timesteps")
        if num_inference_steps is not None and num_inference_steps != len(r) - 1:
            raise ValueError(
                f"num_inference_steps={num_inference_steps} disagrees with the {len(r) - 1} times given; "
                "pass one or the other."
            )
        return r

    def _register_alias(self, **values) -> None:
        """Register config keys given through an alias argument (``sigma_max=``), and take them off diffusers'
        ``_use_default_values``, else ``from_config(self.config)`` would replace them by their defaults."""
        defaulted = [k for k in self.config.get("_use_default_values", []) if k not in values]
        self.register_to_config(**values, _use_default_values=defaulted)

    def _check_pending(self, explicit: bool) -> None:
        """Refuse a step-count grid that silently replaces explicit times nobody stepped through yet (a pipeline's
        own ``set_timesteps(n)`` after the user's ``set_timesteps(sigmas=...)``)."""
        if self._explicit_pending and not explicit:
            self._explicit_pending = False
            raise ValueError(
                "the explicit times set by set_timesteps(sigmas=...) were replaced before any step: diffusers "
                "pipelines call set_timesteps(num_inference_steps) themselves. Pass the times per call (FluxPipeline: "
                "pipe(..., sigmas=[...])) or in the config "
                "(RCMScheduler.from_config(cfg, **rcm_config_for_rf_times(times)) with "
                "rcm_diffusers.sampling.rcm_config_for_rf_times, or sigma_max / mid_t; teachers: spacing / shift); "
                "set_timesteps(sigmas=...) is for loops you drive yourself."
            )
        self._explicit_pending = explicit

    def _network_timesteps(self, r: np.ndarray) -> torch.Tensor:
        """What the transformer is handed: ``r * num_train_timesteps`` (float32)."""
        return torch.from_numpy(r * self.config.num_train_timesteps).to(torch.float32)

    def _set_grid(self, r: np.ndarray, device) -> None:
        self._rf = r
        self.sigmas = torch.from_numpy(r).to(torch.float32)
        self.timesteps = self._network_timesteps(r[:-1]).to(device=device)
        self.num_inference_steps = len(r) - 1
        self._step_index = None
        self._begin_index = None

    @property
    def rf_times(self) -> np.ndarray | None:
        """float64 RF times of the current grid, ending at 0."""
        return self._rf

    @property
    def step_index(self):
        """Index of the next step (``None`` before the first ``step``)."""
        return self._step_index

    @property
    def begin_index(self):
        """First step index, set by pipelines through ``set_begin_index``."""
        return self._begin_index

    def set_begin_index(self, begin_index: int = 0):
        """Start the next run at ``begin_index`` (diffusers pipelines call this with 0)."""
        self._begin_index = begin_index

    def index_for_timestep(self, timestep, schedule_timesteps=None) -> int:
        """Index of ``timestep`` in the grid (the first match)."""
        schedule_timesteps = self.timesteps if schedule_timesteps is None else schedule_timesteps
        t = timestep.to(schedule_timesteps.device) if isinstance(timestep, torch.Tensor) else torch.tensor(timestep)
        idx = torch.isclose(schedule_timesteps, t.to(schedule_timesteps.dtype).reshape(()), rtol=0, atol=1e-3).nonzero()
        if len(idx) == 0:
            raise ValueError(f"timestep {float(t)} is not on this scheduler's grid {self.timesteps.tolist()}.")
        return int(idx[0])

    def _init_step_index(self, timestep) -> None:
        if self._rf is None:
            raise ValueError(
                f"{type(self).__name__}.step() was called before set_timesteps(); "
                "call set_timesteps(num_inference_steps) first."
            )
        self._step_index = self.index_for_timestep(timestep) if self._begin_index is None else self._begin_index

    def _advance(self) -> tuple[float, float]:
        i = self._step_index
        if i >= len(self._rf) - 1:
            raise ValueError(
                f"step() called {i + 1} times for a {len(self._rf) - 1}-step grid; "
                "call set_timesteps() again to start a new run."
            )
        self._step_index += 1
        return float(self._rf[i]), float(self._rf[i + 1])

    def scale_model_input(self, sample: torch.Tensor, timestep=None) -> torch.Tensor:
        """Identity: flow models take ``x_r`` as is."""
        return sample

    def scale_noise(self, sample: torch.Tensor, timestep, noise: torch.Tensor) -> torch.Tensor:
        """Forward process ``x_r = (1 - r) x0 + r noise`` (img2img/vid2vid): ``r`` is the exact RF time of a grid
        timestep (``timesteps`` may be rounded, see ``time_input``), else ``timestep / num_train_timesteps``."""
        ts = torch.as_tensor(timestep, dtype=torch.float64).reshape(-1).cpu()
        r = ts / self.config.num_train_timesteps
        if self._rf is not None and self.timesteps is not None:
            grid = self.timesteps.double().cpu()
            for k, t in enumerate(ts):
                hit = torch.nonzero(torch.isclose(grid, t, rtol=0, atol=1e-3))
                if len(hit):
                    r[k] = float(self._rf[int(hit[0])])
        r = r.to(sample.device).reshape(-1, *([1] * (sample.dim() - 1)))
        return ((1 - r) * sample.double() + r * noise.double()).to(sample.dtype)

    def __len__(self):
        return self.config.num_train_timesteps


def _to_list(x):
    if isinstance(x, torch.Tensor):
        return x.detach().cpu().double().reshape(-1).tolist()
    return list(np.asarray(x, dtype=np.float64).reshape(-1)) if not isinstance(x, (list, tuple)) else list(x)


def _seed_from(sample: torch.Tensor) -> int:
    """A 63-bit seed derived from the bytes of (a strided subset of) ``sample`` (one batch element)."""
    flat = sample.detach().reshape(-1)
    stride = max(1, flat.numel() // 4096)
    data = flat[::stride][:4096].to("cpu", torch.float32).numpy().tobytes()
    return int(hashlib.sha256(data).hexdigest()[:15], 16)


class RCMScheduler(_FlowTimesMixin, SchedulerMixin, ConfigMixin):
    """Few-step consistency sampler of an rCM student (docs/math.md §2.1).

    Step times: TrigFlow angles ``[arctan(sigma_max), *mid_t_for_steps(mid_t, n), 0]`` mapped to RF times
    ``r = sin/(sin+cos)``; each step takes ``x0 = x - r_cur v`` and moves to ``r_next`` by fresh
    noise (``stochastic=True``, default) or the deterministic Euler "ode" update.

    The official sampler starts from ``x = r_0 * noise``. Wan and Flux pipelines hand the first
    transformer call unscaled noise, so for the exact official trajectory pass
    ``latents=scheduler.scale_initial_noise(noise)`` to the pipeline (see docs/sampling.md, "Exact start");
    without it the first input carries ``(1 - r_0) = 1.2%`` (sigma_max 80) more noise than the
    student was trained on (measured effect in docs/benchmarks.md).

    Fresh noise comes from ``step(generator=...)``, else from ``scheduler.generator`` if set (one
    generator: one draw of the batch shape, as the official loop; a list: one draw per sample), else,
    per batch element, from a generator seeded by that element's first-step input latents: stock
    pipelines do not pass their generator to ``step``, and this keeps "same seed -> same sample" and
    makes sample ``i`` depend on generator ``i`` only (as diffusers' own schedulers).

    Args:
        num_train_timesteps: the transformer's timestep scale (``timesteps = r * num_train_timesteps``).
        rcm_sigma_max (argument also ``sigma_max``): EDM sigma of the first step (80 T2V, 200 Wan I2V;
            120 seen for 14B 720p).
        mid_t: intermediate TrigFlow angles, strictly decreasing inside (0, pi/2) and below
            ``arctan(sigma_max)``. A list (or a comma-separated string such as ``"1.5,1.4,1.0"``): ``n`` steps
            use its first ``n-1``, so ``len(mid_t) + 1`` steps at most. Or per step count, a mapping
            ``{2: [1.0], 4: [1.5, 1.4, 0.8]}`` (or the string ``"2: 1.0; 4: 1.5, 1.4, 0.8"``): ``n`` steps use
            the entry keyed ``n``, else the one with the next larger key, cut to ``n-1`` angles
            (:func:`rcm_diffusers.sampling.mid_t_for_steps`). The config holds the JSON form (string keys).
        stochastic: fresh-noise update (True) or deterministic "ode" update (False).
        time_input: the time the network sees, ``timesteps``: ``"bf16"`` (default) = ``r *
            num_train_timesteps`` rounded to bfloat16 as the official rCM sampler and trainer feed it;
            ``"float"`` = exact. Use the ``time_input`` the student was trained with (``RCMConfig.time_input``).
            FluxPipeline divides ``timesteps`` by 1000 and its transformer multiplies by 1000 again, so a float32
            Flux model sees the same rounded ``1000 r`` (a bf16 Flux model casts again, as stock diffusers does).
    """

    _compatibles = list(_OUR_CLASSES)
    _aliases = {"sigma_max": "rcm_sigma_max"}
    ignore_for_config = ["sigma_max"]

    @register_to_config
    def __init__(
        self,
        num_train_timesteps: int = 1000,
        rcm_sigma_max: float = 80.0,
        mid_t: list[float] | dict[str, list[float]] | None = None,
        stochastic: bool = True,
        time_input: str = "bf16",
        sigma_max: float | None = None,
    ):
        if sigma_max is not None:
            rcm_sigma_max = sigma_max
            self._register_alias(rcm_sigma_max=sigma_max)
        _check_finite_positive("sigma_max", rcm_sigma_max)
        _check_finite_positive("num_train_timesteps", num_train_timesteps)
        if not isinstance(stochastic, bool):
            raise ValueError(f"stochastic must be True or False, got {stochastic!r}.")
        if time_input not in TIME_INPUTS:
            raise ValueError(
                f"time_input must be one of {TIME_INPUTS} (the time the student was trained with), got {time_input!r}."
            )
        if mid_t is None:  # default: DEFAULT_MID_T, registered as a list (the config holds no None)
            mid_t = list(DEFAULT_MID_T)
            self.register_to_config(mid_t=mid_t)
        normal = mid_t_as_config(validate_mid_t(mid_t, rcm_sigma_max))  # every angle, against sigma_max too
        if type(mid_t) is not type(normal) or mid_t != normal:
            self.register_to_config(mid_t=normal)
        self.timesteps = None
        self.sigmas = None
        self.num_inference_steps = None
        self._step_index = None
        self._begin_index = None
        self.generator: torch.Generator | list[torch.Generator] | None = None
        self._noise_generators: list[torch.Generator] | None = None
        self.init_noise_sigma = rcm_sigma_max / (1.0 + rcm_sigma_max)

    @classmethod
    def from_lora(cls, path: str, base_config=None, **kwargs) -> "RCMScheduler":
        """The scheduler a student LoRA was trained for: the ``scheduler/`` config ``training/rcm.py`` writes next to
        it (``sigma_max``, ``mid_t``, ``time_input``), laid over ``base_config`` (e.g. ``pipe.scheduler.config``, whose
        other keys such as ``shift`` are kept for swapping back), then ``kwargs``. ``path``: a run folder, its ``ema/``
        (without a ``scheduler/`` of its own: the run's), a LoRA file (its folder) or a Hub repo id. Without an
        ``RCMScheduler`` config there (a LoRA from elsewhere): ``from_config(base_config, **kwargs)`` defaults and a
        warning saying so. Logs (INFO) the settings taken."""
        trained, source = cls._trained_config(path)
        for alias, key in cls._aliases.items():  # sigma_max= in kwargs; configs written by earlier versions
            for d in (kwargs, trained or {}):
                if alias in d and key not in d:
                    d[key] = d.pop(alias)
        if trained is None:
            sched = cls.from_config(base_config or {}, **kwargs)
            warnings.warn(
                f"{path}: no RCMScheduler config (scheduler/scheduler_config.json, written by training/rcm.py) "
                f"next to this LoRA; using RCMScheduler.from_config defaults ({sched._settings()}). If the LoRA "
                "was trained for other settings, pass them: RCMScheduler.from_config(pipe.scheduler.config, "
                "sigma_max=..., mid_t=[...], time_input=...)",
                stacklevel=2,
            )
            return sched
        keys = cls._get_init_keys(cls) - {"self", *cls._aliases}
        # as keyword arguments, so that they win over base_config's keys and its _use_default_values
        sched = cls.from_config(base_config or {}, **{**{k: v for k, v in trained.items() if k in keys}, **kwargs})
        logger.info("rcm_diffusers: RCMScheduler from %s: %s", source, sched._settings())
        return sched

    @classmethod
    def _trained_config(cls, path: str) -> tuple[dict | None, str | None]:
        """``(config, folder)`` of the ``RCMScheduler`` saved for the LoRA at ``path`` (see :meth:`from_lora`), or
        ``(None, None)``."""
        path = os.fspath(path)
        if os.path.isfile(path):
            path = os.path.dirname(path) or "."
        if os.path.isdir(path):
            dirs = [path] + (
                [os.path.dirname(os.path.abspath(path))] if os.path.basename(os.path.normpath(path)) == "ema" else []
            )
            dirs = [d for d in dirs if os.path.isfile(os.path.join(d, "scheduler", cls.config_name))]
            if not dirs:
                return None, None
            path = dirs[0]
        try:
            cfg = dict(cls.load_config(path, subfolder="scheduler"))
        except OSError as e:  # a Hub repo without scheduler/; anything else (offline, no such repo) is raised
            if "does not appear to have a file named" in str(e):
                return None, None
            raise
        if cfg.get("_class_name") != cls.__name__:
            return None, None
        return cfg, os.path.join(path, "scheduler")

    def _settings(self) -> str:
        c = self.config
        return f"sigma_max {c.rcm_sigma_max:g}, mid_t {parse_mid_t(c.mid_t)}, time_input {c.time_input}"

    @property
    def sigma_max(self) -> float:
        """EDM sigma of the first step (config key ``rcm_sigma_max``)."""
        return float(self.config.rcm_sigma_max)

    def _network_timesteps(self, r: np.ndarray) -> torch.Tensor:
        """``r * num_train_timesteps``; with ``time_input="bf16"`` computed as the official sampler does,
        ``(float32(r) * 1000).to(bfloat16)`` (docs/math.md §2.1), returned as float32."""
        if self.config.time_input == "float":
            return super()._network_timesteps(r)
        ts = torch.from_numpy(np.asarray(r, dtype=np.float64)).float().double() * self.config.num_train_timesteps
        return ts.to(torch.bfloat16).to(torch.float32)

    def set_timesteps(
        self,
        num_inference_steps: int | None = None,
        device: str | torch.device | None = None,
        sigmas: list[float] | None = None,
        timesteps: list[float] | None = None,
        mu: float | None = None,
    ):
        """Build the grid: ``n`` rCM steps from the config, or explicit RF times (``sigmas``) / ``timesteps``.

        ``mu`` (FluxPipeline's resolution shift) is accepted and ignored: the student's times are fixed.
        """
        r = self._explicit_rf(num_inference_steps, sigmas, timesteps)
        self._check_pending(explicit=r is not None)
        if r is None:
            num_inference_steps = num_inference_steps if num_inference_steps is not None else self._flux_default_steps
            if num_inference_steps is None:
                raise ValueError(
                    "set_timesteps needs num_inference_steps (1..4 by default) or explicit sigmas (RF times)."
                )
            r = rcm_rf_times(num_inference_steps, self.config.rcm_sigma_max, self.config.mid_t)
        self._set_grid(r, device)
        self.init_noise_sigma = float(r[0])
        self._noise_generators = None

    def scale_initial_noise(self, noise: torch.Tensor) -> torch.Tensor:
        """``x = r_0 * noise``: the official sampler's first input (docs/math.md §2.1). Call after ``set_timesteps``,
        or it uses the config's ``sigma_max`` (``r_0 = sigma_max / (1 + sigma_max)``)."""
        r0 = float(self._rf[0]) if self._rf is not None else self.sigma_max / (1.0 + self.sigma_max)
        return (noise.double() * r0).to(noise.dtype)

    def set_generator(self, generator: torch.Generator | list[torch.Generator] | None) -> None:
        """Draw the fresh noise of later steps from ``generator`` (one, or one per batch element) for pipelines
        that do not pass one to ``step``."""
        self.generator = generator

    def _fresh_noise(self, sample: torch.Tensor, generator) -> torch.Tensor:
        gen = generator if generator is not None else self.generator
        if gen is None:
            if self._noise_generators is None or len(self._noise_generators) != sample.shape[0]:
                # one generator per batch element, seeded by that element's first input only
                self._noise_generators = [torch.Generator("cpu").manual_seed(_seed_from(x)) for x in sample]
            gen = self._noise_generators
        if isinstance(gen, (list, tuple)) and len(gen) != sample.shape[0]:
            raise ValueError(
                f"got {len(gen)} generators for a batch of {sample.shape[0]}; pass one per sample or a single one."
            )
        if isinstance(gen, (list, tuple)) and len(gen) == 1:
            gen = gen[0]
        return randn_tensor(sample.shape, generator=gen, device=sample.device, dtype=torch.float32)

    def step(
        self,
        model_output: torch.Tensor,
        timestep: float | torch.Tensor,
        sample: torch.Tensor,
        generator: torch.Generator | None = None,
        return_dict: bool = True,
    ) -> RCMSchedulerOutput | tuple:
        """``x0 = x - r_cur v``; then ``x' = (1 - r_next) x0 + r_next noise`` (stochastic) or
        ``x' = x - (r_cur - r_next) v`` (ode). float64 arithmetic, result in ``sample``'s dtype (docs/math.md §2.1)."""
        if self._rf is None:
            raise ValueError(
                "RCMScheduler.step() was called before set_timesteps(); call set_timesteps(num_inference_steps) first."
            )
        self._explicit_pending = False
        if self._step_index is None:
            self._init_step_index(timestep)
        if not torch.isfinite(model_output).all():
            raise ValueError(
                f"model_output holds NaN or inf at step {self._step_index}; check the model and its inputs."
            )
        r_cur, r_next = self._advance()
        x = sample.double()
        x0 = x - r_cur * model_output.double()
        noise = None
        if self.config.stochastic and r_next > 0:
            noise = self._fresh_noise(sample, generator).double()
        prev = rcm_update(x, x0, r_cur, r_next, noise=noise, stochastic=self.config.stochastic)
        prev, x0 = prev.to(sample.dtype), x0.to(sample.dtype)
        if not return_dict:
            return (prev, x0)
        return RCMSchedulerOutput(prev_sample=prev, pred_original_sample=x0)


class _TeacherGridMixin(_FlowTimesMixin):
    """Teacher grid of docs/math.md §2.2 from the config (``sigma_max``, ``spacing``, shift or dynamic shift)."""

    _aliases = {"sigma_max": "teacher_sigma_max", "sigma_min": "teacher_sigma_min"}
    ignore_for_config = ["sigma_max", "sigma_min"]

    def _apply_aliases(self, sigma_max, sigma_min) -> None:
        if sigma_max is not None:
            self._register_alias(teacher_sigma_max=sigma_max)
        if sigma_min is not None:
            self._register_alias(teacher_sigma_min=sigma_min)

    @property
    def sigma_max(self) -> float:
        """EDM sigma of the first grid point (config key ``teacher_sigma_max``)."""
        return float(self.config.teacher_sigma_max)

    def _check_model_output(self, model_output: torch.Tensor) -> None:
        self._explicit_pending = False
        if not torch.isfinite(model_output).all():
            raise ValueError(
                f"model_output holds NaN or inf at step {self.step_index}; check the model and its inputs "
                "(the teacher solvers refuse to carry it into the latents)."
            )

    def _check_teacher_config(self) -> None:
        c = self.config
        _check_finite_positive("sigma_max", c.teacher_sigma_max)
        _check_finite_positive("num_train_timesteps", c.num_train_timesteps)
        if c.spacing not in SPACINGS:
            raise ValueError(f"unknown spacing {c.spacing!r}; choose one of {SPACINGS}.")
        _check_finite_positive("shift", self.effective_shift)
        if c.time_shift_type not in ("exponential", "linear"):
            raise ValueError(f"time_shift_type must be 'exponential' or 'linear', got {c.time_shift_type!r}.")

    @property
    def effective_shift(self) -> float:
        """``flow_shift`` when a Wan/UniPC config set it, else ``shift``."""
        fs = self.config.flow_shift
        return float(fs) if fs is not None else float(self.config.shift)

    def _teacher_rf(self, num_inference_steps, sigmas, timesteps, mu) -> np.ndarray:
        r = self._explicit_rf(num_inference_steps, sigmas, timesteps)
        self._check_pending(explicit=r is not None)
        if r is not None:
            return r
        num_inference_steps = num_inference_steps if num_inference_steps is not None else self._flux_default_steps
        if num_inference_steps is None:
            raise ValueError("set_timesteps needs num_inference_steps or explicit sigmas (RF times).")
        c = self.config
        shift = self.effective_shift
        if c.use_dynamic_shifting:
            if mu is None:
                raise ValueError("`mu` must be passed when use_dynamic_shifting=True (FluxPipeline computes it).")
            shift = math.exp(mu) if c.time_shift_type == "exponential" else float(mu)
        return teacher_rf_grid(
            num_inference_steps, c.teacher_sigma_max, c.spacing, shift, c.rho, c.teacher_sigma_min, c.shift_b
        )


class TrigFlowEulerScheduler(_TeacherGridMixin, SchedulerMixin, ConfigMixin):
    """Teacher flow-ODE Euler solver ``x_{i+1} = x_i + v (r_{i+1} - r_i)`` on the docs/math.md §2.2 grid.

    In TrigFlow terms each step is the exact DDIM move ``x_s = cos(t-s) x_t - sin(t-s) F``.
    Grid: from ``r_max = sigma_max/(1+sigma_max)`` to 0, ``linear`` (uniform then shifted, the start
    un-shifted so the shifted grid starts at ``r_max``), ``karras`` (rho) or ``exponential`` in sigma.
    With ``use_dynamic_shifting`` (Flux) the shift is ``exp(mu)`` (``time_shift_type="exponential"``)
    or ``mu`` (``"linear"``), raised to ``shift_b``: ``r' = a / (a + (1/r - 1)^b)``.
    """

    _compatibles = list(_OUR_CLASSES)

    @register_to_config
    def __init__(
        self,
        num_train_timesteps: int = 1000,
        teacher_sigma_max: float = 5000.0,
        spacing: str = "linear",
        shift: float = 1.0,
        flow_shift: float | None = None,
        rho: float = 7.0,
        teacher_sigma_min: float = 0.002,
        shift_b: float = 1.0,
        use_dynamic_shifting: bool = False,
        base_shift: float = 0.5,
        max_shift: float = 1.15,
        base_image_seq_len: int = 256,
        max_image_seq_len: int = 4096,
        time_shift_type: str = "exponential",
        sigma_max: float | None = None,
        sigma_min: float | None = None,
    ):
        self._apply_aliases(sigma_max, sigma_min)
        self._check_teacher_config()
        self.timesteps = None
        self.sigmas = None
        self.num_inference_steps = None
        self._step_index = None
        self._begin_index = None
        self.init_noise_sigma = 1.0

    def set_timesteps(self, num_inference_steps=None, device=None, sigmas=None, timesteps=None, mu=None):
        """Build the docs/math.md §2.2 grid, or take explicit RF times (``sigmas``) / ``timesteps`` as given."""
        self._set_grid(self._teacher_rf(num_inference_steps, sigmas, timesteps, mu), device)

    def step(self, model_output, timestep, sample, generator=None, return_dict: bool = True):
        """Euler: ``x' = x + (r_next - r_cur) v``, float64 arithmetic (docs/math.md §2.2)."""
        if self._rf is None:
            raise ValueError(
                "TrigFlowEulerScheduler.step() was called before set_timesteps(); "
                "call set_timesteps(num_inference_steps) first."
            )
        if self._step_index is None:
            self._init_step_index(timestep)
        self._check_model_output(model_output)
        r_cur, r_next = self._advance()
        v = model_output.double()
        prev = sample.double() + (r_next - r_cur) * v
        x0 = sample.double() - r_cur * v
        prev, x0 = prev.to(sample.dtype), x0.to(sample.dtype)
        if not return_dict:
            return (prev, x0)
        return RCMSchedulerOutput(prev_sample=prev, pred_original_sample=x0)


class TrigFlowUniPCScheduler(_TeacherGridMixin, SchedulerMixin, ConfigMixin):
    """Teacher UniPC (bh2, order 2-3, flow prediction) on the docs/math.md §2.2 grid.

    The predictor-corrector itself is diffusers' ``UniPCMultistepScheduler`` (flow_prediction,
    use_flow_sigmas, no internal shift), held inside and fed this scheduler's grid; so results
    equal diffusers' UniPC on the same grid. Config as :class:`TrigFlowEulerScheduler`, plus
    ``solver_order``, ``solver_type``, ``lower_order_final``, ``disable_corrector``.
    """

    _compatibles = list(_OUR_CLASSES)

    @register_to_config
    def __init__(
        self,
        num_train_timesteps: int = 1000,
        teacher_sigma_max: float = 5000.0,
        spacing: str = "linear",
        shift: float = 1.0,
        flow_shift: float | None = None,
        rho: float = 7.0,
        teacher_sigma_min: float = 0.002,
        shift_b: float = 1.0,
        solver_order: int = 2,
        solver_type: str = "bh2",
        lower_order_final: bool = True,
        disable_corrector: list[int] | None = None,
        use_dynamic_shifting: bool = False,
        base_shift: float = 0.5,
        max_shift: float = 1.15,
        base_image_seq_len: int = 256,
        max_image_seq_len: int = 4096,
        time_shift_type: str = "exponential",
        sigma_max: float | None = None,
        sigma_min: float | None = None,
    ):
        self._apply_aliases(sigma_max, sigma_min)
        self._check_teacher_config()
        if solver_order not in (1, 2, 3):
            raise ValueError(f"solver_order must be 1, 2 or 3, got {solver_order!r}.")
        # diffusers' UniPC divides by the final zero sigma in these settings and returns NaN (or fails to solve)
        if solver_type != "bh2":
            raise ValueError(
                f"solver_type={solver_type!r} gives NaN at the final zero sigma of the flow grid; "
                "use solver_type='bh2' (or TrigFlowEulerScheduler)."
            )
        if not lower_order_final and solver_order > 1:
            raise ValueError(
                "lower_order_final=False gives NaN (or a singular solve) at the final zero sigma of the flow grid for "
                "solver_order > 1; keep lower_order_final=True."
            )
        if disable_corrector is None:  # default: none, registered as [] (the config holds no None)
            disable_corrector = []
            self.register_to_config(disable_corrector=disable_corrector)
        self._solver = UniPCMultistepScheduler(
            num_train_timesteps=num_train_timesteps,
            solver_order=solver_order,
            solver_type=solver_type,
            prediction_type="flow_prediction",
            use_flow_sigmas=True,
            flow_shift=1.0,
            lower_order_final=lower_order_final,
            disable_corrector=list(disable_corrector),
            final_sigmas_type="zero",
        )
        self.timesteps = None
        self.sigmas = None
        self.num_inference_steps = None
        self._step_index = None
        self._begin_index = None
        self.init_noise_sigma = 1.0

    def set_timesteps(self, num_inference_steps=None, device=None, sigmas=None, timesteps=None, mu=None):
        """Build the grid as :class:`TrigFlowEulerScheduler` and hand it to the inner UniPC solver."""
        r = self._teacher_rf(num_inference_steps, sigmas, timesteps, mu)
        self._set_grid(r, device)
        self._solver.set_timesteps(sigmas=r[:-1].copy(), device=device)
        # the inner solver nudges a first sigma of exactly 1 down by 1e-6 (log-SNR finite); mirror it
        self.sigmas = self._solver.sigmas.clone()
        self._rf = self.sigmas.double().numpy()
        self._solver.timesteps = self.timesteps

    @property
    def step_index(self):
        return self._solver.step_index

    @property
    def begin_index(self):
        return self._solver.begin_index

    def set_begin_index(self, begin_index: int = 0):
        self._solver.set_begin_index(begin_index)

    def step(self, model_output, timestep, sample, generator=None, return_dict: bool = True):
        """One UniPC predictor-corrector step (diffusers' solver, this scheduler's grid)."""
        if self._rf is None:
            raise ValueError(
                "TrigFlowUniPCScheduler.step() was called before set_timesteps(); "
                "call set_timesteps(num_inference_steps) first."
            )
        if self._solver.step_index is not None and self._solver.step_index >= self.num_inference_steps:
            raise ValueError("step() called past the end of the grid; call set_timesteps() again to start a new run.")
        self._check_model_output(model_output)
        return self._solver.step(model_output, timestep, sample, return_dict=return_dict)


# diffusers records a custom component as (its class's __module__, class name) in model_index.json;
# the public path makes that ["rcm_diffusers", "RCMScheduler"], stable across internal moves.
for _cls in (RCMScheduler, TrigFlowEulerScheduler, TrigFlowUniPCScheduler):
    _cls.__module__ = "rcm_diffusers"
