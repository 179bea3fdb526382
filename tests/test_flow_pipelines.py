"""RCMScheduler in every stock flow-matching pipeline of diffusers (tiny random models, tests/flow_models.py).

For each pipeline, 1 to 4 steps: the grid every scheduler of the pipeline ends up with is ``rcm_rf_times(n)``, the
transformer sees ``bf16(1000 r_i)`` in the pipeline's own time convention, the output is finite and not constant,
the pipeline's form of its default grid is pinned (what it hands ``set_timesteps``), ``mu`` is accepted and ignored,
and with a generator list sample ``i`` depends on generator ``i`` only.
"""

import functools
import inspect
import math

import diffusers
import numpy as np
import pytest
import torch
from flow_models import CASES, case
from packaging.version import Version

from rcm_diffusers import RCMScheduler
from rcm_diffusers.sampling import DEFAULT_MID_T, rcm_rf_times


def _mochi_schedule(n):
    from diffusers.pipelines.mochi.pipeline_mochi import linear_quadratic_schedule

    return linear_quadratic_schedule(n, 0.025)


GRID_FORMS = {
    # set_timesteps(num_inference_steps)
    "steps": None,
    # sigmas=np.linspace(1, 1/n, n): float64, bit-equal to k/n only for n = 1, 2, 4, 8, ...
    "np.linspace(1, 1/n, n)": lambda n: {"sigmas": np.linspace(1.0, 1 / n, n)},
    # sigmas=np.linspace(1, 0, n+1)[:-1]
    "np.linspace(1, 0, n+1)[:-1]": lambda n: {"sigmas": np.linspace(1.0, 0.0, n + 1)[:-1]},
    # sigmas=torch.linspace(1, 1/n, n).tolist(): float32 values
    "torch.linspace(1, 1/n, n).tolist()": lambda n: {"sigmas": torch.linspace(1.0, 1 / n, n).tolist()},
    # Mochi's linear-quadratic schedule (threshold 0.025), as np.array
    "mochi linear-quadratic": lambda n: {"sigmas": np.array(_mochi_schedule(n))},
    # timesteps=int(linspace(1000, 1, n)) and sigmas=timesteps/1000, both at once
    "timesteps=int(linspace(1000, 1, n)), sigmas=timesteps/1000": lambda n: {
        "timesteps": np.linspace(1000, 1.0, n).astype(np.int64).astype(np.float32),
        "sigmas": np.linspace(1000, 1.0, n).astype(np.int64).astype(np.float32) / 1000,
    },
}

# pipeline -> (its default-grid form, or {first diffusers version: form}; whether it passes mu; the time the
# transformer gets from timestep = 1000 r)
TABLE = {
    "Wan 2.1": ("steps", False, "t"),
    "Wan 2.2": ("steps", False, "t"),
    "FLUX.1": ("np.linspace(1, 1/n, n)", True, "t/1000"),
    "FLUX.2": ("np.linspace(1, 1/n, n)", True, "t/1000"),
    "Qwen-Image": ("np.linspace(1, 1/n, n)", True, "t/1000"),
    "Z-Image": ({"0.37": "steps", "0.39": "torch.linspace(1, 1/n, n).tolist()"}, True, "(1000-t)/1000"),
    "SD3": ("steps", False, "t"),
    "Chroma": ("np.linspace(1, 1/n, n)", True, "t/1000"),
    "CogView4": ("timesteps=int(linspace(1000, 1, n)), sigmas=timesteps/1000", True, "t"),
    "SkyReels V2": ("steps", False, "t"),
    "SanaVideo": ("steps", False, "t"),
    "HunyuanVideo-1.5": ("np.linspace(1, 0, n+1)[:-1]", False, "t"),
    "LTX-2": ("np.linspace(1, 1/n, n)", True, "t"),
    "HiDream": ("steps", True, "t"),
    "FLUX.2 [klein]": ("np.linspace(1, 1/n, n)", True, "t/1000"),
    "AuraFlow": ("steps", False, "t/1000"),
    "Lumina 2": ("np.linspace(1, 1/n, n)", True, "(1000-t)/1000"),
    "HunyuanVideo": ("np.linspace(1, 0, n+1)[:-1]", False, "t"),
    "LTX-Video": ("np.linspace(1, 1/n, n)", True, "t"),
    # Mochi passes its own linear-quadratic schedule: not a default form, so its times are used as given
    "Mochi": ("mochi linear-quadratic", False, "t"),
}
#: pipelines whose default times are not one of the recognised forms: the grid is theirs, not rCM's
OWN_GRID = {"Mochi"}
TIME_SEEN = {"t": lambda t: t, "t/1000": lambda t: t / 1000, "(1000-t)/1000": lambda t: (1000 - t) / 1000}


def _form(entry):
    """The form for the installed diffusers: the entry of the latest version not above it."""
    if isinstance(entry, str):
        return entry
    installed = Version(diffusers.__version__).release[:2]
    return [
        form for v, form in sorted(entry.items(), key=lambda kv: Version(kv[0])) if Version(v).release <= installed
    ][-1]


def _available(name):
    c = case(name)
    return pytest.param(name, marks=pytest.mark.skipif(not c.available, reason=f"diffusers without {c.pipeline}"))


NAMES = [_available(c.name) for c in CASES]


def test_table_covers_every_case():
    assert sorted(TABLE) == sorted(c.name for c in CASES)


def _spy(scheduler, calls):
    """Record every ``set_timesteps`` call (args, kwargs, the grid it made); survives ``copy.deepcopy`` (LTX-2 copies
    the scheduler for its audio latents), whose copy records into the same list."""
    stock = type(scheduler).set_timesteps

    @functools.wraps(stock)  # pipelines inspect the signature for `sigmas` / `timesteps`
    def set_timesteps(self, *args, **kwargs):
        stock(self, *args, **kwargs)
        calls.append((args, kwargs, self.rf_times.copy()))

    scheduler.set_timesteps = set_timesteps.__get__(scheduler)


def _time_recorder(pipe, c, seen):
    def hook(_module, args, kwargs):
        t = kwargs.get(c.t_arg) if isinstance(c.t_arg, str) else args[c.t_arg]
        seen.append(float(t.reshape(-1)[0]))

    return [
        m.register_forward_pre_hook(hook, with_kwargs=True)
        for m in (getattr(pipe, "transformer", None), getattr(pipe, "transformer_2", None))
        if m is not None
    ]


def _call(pipe, c, batch=None, **kw):
    """The pipeline's call with the case's arguments (for ``batch`` samples); those this diffusers version's pipeline
    lacks are left out."""
    params = inspect.signature(type(pipe).__call__).parameters
    base = c.kwargs() if batch is None else c.batch_kwargs(batch)
    args = {k: v for k, v in {**base, **kw}.items() if k in params}
    return getattr(pipe(**args), c.out)


def _bf16_timesteps(r):
    return [float(torch.tensor(float(np.float32(x)) * 1000.0, dtype=torch.float32).to(torch.bfloat16)) for x in r]


def _assert_form(form, call, n):
    args, kwargs, _ = call
    if GRID_FORMS[form] is None:
        assert (args[:1] == (n,) or kwargs.get("num_inference_steps") == n) and "sigmas" not in kwargs, call
        return
    for key, want in GRID_FORMS[form](n).items():
        got = kwargs[key]
        assert type(got) is type(want), (key, type(got), type(want))
        assert np.array_equal(np.asarray(got, dtype=np.float64), np.asarray(want, dtype=np.float64)), (key, got, want)


@pytest.mark.parametrize("name", NAMES)
def test_rcm_grid_in_stock_pipeline(name):
    c = case(name)
    form, passes_mu, time_seen = TABLE[name]
    form = _form(form)
    pipe = c.build()
    pipe.set_progress_bar_config(disable=True)
    pipe.scheduler = RCMScheduler.from_config(pipe.scheduler.config)
    calls, seen = [], []
    _spy(pipe.scheduler, calls)
    hooks = _time_recorder(pipe, c, seen)
    for n in (1, 2, 3, 4) if name != "Mochi" else (2, 3, 4):  # Mochi's schedule divides by n // 2: no 1 step
        calls.clear(), seen.clear()
        out = _call(pipe, c, num_inference_steps=n, generator=torch.Generator().manual_seed(n))
        grid = rcm_rf_times(n, 80.0, DEFAULT_MID_T) if name not in OWN_GRID else np.append(_mochi_schedule(n), 0.0)
        assert calls and all(np.array_equal(rf, grid) for *_, rf in calls), (n, calls)
        _assert_form(form, calls[0], n)
        assert ("mu" in calls[0][1]) == passes_mu  # passed by the pipeline, and the grid above ignores it
        want = [TIME_SEEN[time_seen](t) for t in _bf16_timesteps(grid[:-1])]
        assert seen == pytest.approx(want, rel=1e-6, abs=1e-6), (n, seen, want)
        out = out[0] if isinstance(out, (list, tuple)) else out
        assert torch.isfinite(out).all() and out.std() > 1e-3
    for h in hooks:
        h.remove()


@pytest.mark.parametrize("name", NAMES)
def test_generator_list_sample_i_depends_only_on_generator_i(name):
    c = case(name)
    pipe = c.build()
    pipe.set_progress_bar_config(disable=True)
    pipe.scheduler = RCMScheduler.from_config(pipe.scheduler.config)

    def run(seeds):
        gens = [torch.Generator().manual_seed(s) for s in seeds]
        out = _call(pipe, c, batch=len(seeds), num_inference_steps=2, generator=gens)
        return out if isinstance(out, torch.Tensor) else torch.stack(list(out))

    a, b = run([0, 1]), run([0, 5])
    # float32 round-off of O(1) latents over 2 steps; another generator changes a sample by O(1)
    torch.testing.assert_close(a[0], b[0], rtol=0, atol=1e-5)
    assert (a[1] - b[1]).abs().max() > 0.1


def test_mu_is_accepted_and_ignored():
    for mu in (None, 0.0, 1.3, math.log(3.0)):
        s = RCMScheduler()
        s.set_timesteps(3, mu=mu)
        assert np.array_equal(s.rf_times, rcm_rf_times(3))


# ----------------------------------------------------------------------------- the default-grid forms, 1 to 8 steps


DEFAULT_FORMS = {
    "np.linspace(1, 1/n, n)": lambda n: dict(sigmas=np.linspace(1.0, 1 / n, n)),
    "np.linspace(1, 0, n+1)[:-1]": lambda n: dict(sigmas=np.linspace(1.0, 0.0, n + 1)[:-1]),
    "np.linspace(1, 0, n+1) with its 0": lambda n: dict(sigmas=np.linspace(1.0, 0.0, n + 1)),
    "torch.linspace(1, 1/n, n).tolist()": lambda n: dict(sigmas=torch.linspace(1.0, 1 / n, n).tolist()),
    "float32 tensor torch.linspace(1, 0, n+1)[:-1]": lambda n: dict(sigmas=torch.linspace(1.0, 0.0, n + 1)[:-1]),
    "timesteps=np.linspace(1000, 1, n)": lambda n: dict(timesteps=np.linspace(1000.0, 1.0, n)),
    "CogView4 timesteps + sigmas": lambda n: dict(
        timesteps=np.linspace(1000, 1.0, n).astype(np.int64).astype(np.float32),
        sigmas=np.linspace(1000, 1.0, n).astype(np.int64).astype(np.float32) / 1000,
    ),
}


@pytest.mark.parametrize("form", list(DEFAULT_FORMS))
def test_every_default_form_reads_as_n_steps_of_the_rcm_grid(form):
    """1 to 8 steps (a mid_t of 7 angles): each form, bit-equal to k/n or not, gives the rCM grid; so do the teacher
    schedulers their own grid."""
    from rcm_diffusers import TrigFlowEulerScheduler

    mid_t = [1.5, 1.45, 1.4, 1.3, 1.2, 1.0, 0.8]
    for n in range(1, 9):
        s = RCMScheduler(mid_t=mid_t)
        s.set_timesteps(**DEFAULT_FORMS[form](n), mu=0.7)
        assert np.array_equal(s.rf_times, rcm_rf_times(n, 80.0, mid_t)), (form, n)
        teacher, ref = TrigFlowEulerScheduler(), TrigFlowEulerScheduler()
        teacher.set_timesteps(**DEFAULT_FORMS[form](n))
        ref.set_timesteps(n)
        assert np.array_equal(teacher.rf_times, ref.rf_times), (form, n)


def test_explicit_times_stay_explicit():
    """Times that are not a default form are used as given: user grids, a uniform grid that does not start at 1,
    CogView4 with the user's sigmas (its timesteps then the default ones) or the user's timesteps."""
    for kw, want in [
        (dict(sigmas=[0.9, 0.6, 0.3]), [0.9, 0.6, 0.3]),
        (dict(sigmas=np.linspace(0.99, 0.33, 3)), [0.99, 0.66, 0.33]),
        (dict(sigmas=[1.0, 0.5 + 1e-3]), [1.0, 0.501]),  # 1e-3 off the 2-step default: explicit
        (
            dict(timesteps=np.linspace(1000, 1.0, 3).astype(np.int64).astype(np.float32), sigmas=[0.9, 0.6, 0.3]),
            [0.9, 0.6, 0.3],
        ),
        (
            dict(timesteps=np.array([900.0, 600.0, 300.0]), sigmas=np.array([900.0, 600.0, 300.0]) / 1000),
            [0.9, 0.6, 0.3],
        ),
    ]:
        s = RCMScheduler(time_input="float")
        s.set_timesteps(**kw)
        np.testing.assert_allclose(s.rf_times, [*want, 0.0], rtol=0, atol=1e-12)


def test_disagreeing_sigmas_and_timesteps_are_refused():
    with pytest.raises(ValueError, match=r"sigmas \(RF times\) and timesteps disagree"):
        RCMScheduler().set_timesteps(sigmas=[0.9, 0.6], timesteps=[700.0, 300.0])
