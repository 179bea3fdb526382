"""RCMScheduler and TrigFlow teacher schedulers (docs/math.md §2) against float64 references and diffusers."""

import math

import numpy as np
import pytest
import torch
from diffusers import FlowMatchEulerDiscreteScheduler, UniPCMultistepScheduler
from tiny import flux_scheduler_config, wan_scheduler_config

from rcm_diffusers import RCMScheduler, TrigFlowEulerScheduler, TrigFlowUniPCScheduler
from rcm_diffusers.sampling import shift_family, teacher_rf_grid

SPEC_RF_4 = [0.98765, 0.93378, 0.85289, 0.60898, 0.0]


def _rf(t):
    return math.sin(t) / (math.sin(t) + math.cos(t))


# ----------------------------------------------------------------------------- RCMScheduler grid


def test_rcm_times_match_spec_numbers():
    s = RCMScheduler()
    s.set_timesteps(4)
    assert np.allclose(s.sigmas.numpy(), SPEC_RF_4, atol=1e-5)
    assert abs(s.rf_times[0] - 80 / 81) < 1e-12
    # default time_input="bf16": the official sampler's (1000 r).to(bfloat16); "float": exact 1000 r
    assert s.timesteps.tolist() == [988.0, 932.0, 852.0, 608.0]
    f = RCMScheduler(time_input="float")
    f.set_timesteps(4)
    assert torch.allclose(f.timesteps.double(), torch.from_numpy(f.rf_times[:-1] * 1000), rtol=0, atol=1e-4)
    assert np.array_equal(f.rf_times, s.rf_times)  # the update's times do not depend on time_input
    assert s.init_noise_sigma == pytest.approx(80 / 81, abs=1e-12)


@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_rcm_times_each_step_count(n):
    s = RCMScheduler()
    s.set_timesteps(n)
    angles = [math.atan(80.0), 1.5, 1.4, 1.0][:n]
    expected = [_rf(a) for a in angles] + [0.0]
    assert len(s.timesteps) == n
    assert np.allclose(s.rf_times, expected, atol=1e-14)


def test_custom_angles_and_sigma_max():
    s = RCMScheduler(sigma_max=200.0, mid_t=[1.3, 1.1, 0.7, 0.3])
    s.set_timesteps(5)
    expected = [_rf(a) for a in [math.atan(200.0), 1.3, 1.1, 0.7, 0.3]] + [0.0]
    assert np.allclose(s.rf_times, expected, atol=1e-14)


def test_explicit_rf_times_and_timesteps():
    s = RCMScheduler()
    s.set_timesteps(sigmas=[0.99, 0.7, 0.3])
    assert np.allclose(s.rf_times, [0.99, 0.7, 0.3, 0.0]) and s.num_inference_steps == 3
    s.set_timesteps(timesteps=[990.0, 500.0])
    assert np.allclose(s.rf_times, [0.99, 0.5, 0.0])


@pytest.mark.parametrize(
    "kwargs, call, match",
    [
        ({}, dict(num_inference_steps=0), r"1\.\.4"),
        ({}, dict(num_inference_steps=5), r"1\.\.4"),
        ({}, dict(num_inference_steps=50), r"num_inference_steps=4"),
        ({}, dict(), "num_inference_steps"),
        ({}, dict(sigmas=[0.5, 0.7]), "strictly decreasing"),
        ({}, dict(sigmas=[0.9, float("nan")]), "NaN or inf"),
        ({}, dict(sigmas=[1.5, 0.5]), r"\(0, 1\]"),
        ({}, dict(timesteps=[float("inf"), 10.0]), "NaN or inf"),
        ({}, dict(num_inference_steps=3, sigmas=[0.9, 0.5]), "disagrees"),
        ({}, dict(sigmas=[0.9], timesteps=[500.0]), "sigmas .RF times. and timesteps disagree"),
    ],
)
def test_rcm_set_timesteps_bad_input(kwargs, call, match):
    s = RCMScheduler(**kwargs)
    with pytest.raises(ValueError, match=match):
        s.set_timesteps(**call)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(sigma_max=0.0), "sigma_max"),
        (dict(sigma_max=-3.0), "sigma_max"),
        (dict(sigma_max=float("nan")), "sigma_max"),
        (dict(mid_t=[1.0, 1.4]), "strictly decreasing"),
        (dict(mid_t=[1.6, 1.0]), r"\(0, pi/2\)|strictly decreasing"),
        (dict(mid_t=[1.0, 0.0]), r"\(0, pi/2\)"),
        (dict(sigma_max=1.0, mid_t=[1.5]), "arctan"),
        (dict(mid_t=[1.5, float("inf")]), "finite"),
        (dict(stochastic="yes"), "stochastic"),
    ],
)
def test_rcm_config_bad_input(kwargs, match):
    with pytest.raises(ValueError, match=match):
        RCMScheduler(**kwargs)


def test_step_before_set_timesteps_and_past_end():
    s = RCMScheduler()
    x = torch.zeros(1, 2)
    with pytest.raises(ValueError, match="set_timesteps"):
        s.step(x, 987.0, x)
    s.set_timesteps(1)
    s.step(x, s.timesteps[0], x)
    with pytest.raises(ValueError, match="set_timesteps"):
        s.step(x, s.timesteps[0], x)
    s.set_timesteps(2)
    with pytest.raises(ValueError, match="NaN or inf"):
        s.step(torch.full_like(x, float("nan")), s.timesteps[0], x)


# ----------------------------------------------------------------------------- RCMScheduler step


def _velocity(x, r):
    return torch.sin(2.0 * x) + r * x


@pytest.mark.parametrize("stochastic", [True, False])
def test_rcm_step_equals_float64_loop(stochastic):
    s = RCMScheduler(stochastic=stochastic)
    s.set_timesteps(4)
    g_ref = torch.Generator().manual_seed(11)
    noise = torch.randn(2, 3, 4, 4, generator=torch.Generator().manual_seed(5))
    # scheduler
    x = s.scale_initial_noise(noise)
    s.set_generator(torch.Generator().manual_seed(11))
    for i, t in enumerate(s.timesteps):
        out = s.step(_velocity(x, float(s.sigmas[i])), t, x)
        x = out.prev_sample
    # reference: docs/math.md §2.1 written out in float64
    r = [_rf(a) for a in [math.atan(80.0), 1.5, 1.4, 1.0]] + [0.0]
    y = r[0] * noise.double()
    for i in range(4):
        v = _velocity(y.float(), float(np.float32(r[i]))).double()
        x0 = y - r[i] * v
        if stochastic:
            fresh = torch.randn(y.shape, generator=g_ref, dtype=torch.float32).double() if r[i + 1] > 0 else 0
            y = (1 - r[i + 1]) * x0 + r[i + 1] * fresh
        else:
            y = y - (r[i] - r[i + 1]) * v
    assert torch.allclose(x.double(), y, atol=1e-5, rtol=1e-5)
    assert torch.equal(out.pred_original_sample, x)  # the last step returns x0


def test_rcm_stochastic_seeding_from_latents():
    """Without a generator, the fresh noise is a function of the run's first latents."""

    def run(seed):
        s = RCMScheduler()
        s.set_timesteps(4)
        x = torch.randn(1, 4, 8, 8, generator=torch.Generator().manual_seed(seed))
        for i, t in enumerate(s.timesteps):
            x = s.step(_velocity(x, float(s.sigmas[i])), t, x).prev_sample
        return x

    a, b, c = run(0), run(0), run(1)
    assert torch.equal(a, b)
    assert not torch.allclose(a, c)


# ----------------------------------------------------------------------------- configs


def test_from_config_keeps_wan_and_flux_keys(tmp_path):
    wan = RCMScheduler.from_config(wan_scheduler_config())
    assert wan.config.flow_shift == 3.0 and wan.config.rcm_sigma_max == 80.0 and wan.sigma_max == 80.0
    flux = RCMScheduler.from_config(flux_scheduler_config())
    assert flux.config.use_dynamic_shifting is True and flux.config.shift == 3.0 and flux.config.max_shift == 1.15
    # and back: FlowMatchEuler recovers Flux's keys from an RCMScheduler config
    back = FlowMatchEulerDiscreteScheduler.from_config(flux.config)
    assert back.config.use_dynamic_shifting and back.config.shift == 3.0 and back.config.base_image_seq_len == 256
    custom = RCMScheduler.from_config(wan_scheduler_config(), sigma_max=200.0, mid_t=[1.2, 0.9], stochastic=False)
    custom.save_pretrained(tmp_path)
    loaded = RCMScheduler.from_pretrained(tmp_path)
    assert loaded.sigma_max == 200.0 and list(loaded.config.mid_t) == [1.2, 0.9]
    assert loaded.config.stochastic is False and loaded.config.flow_shift == 3.0
    loaded.set_timesteps(3)
    custom.set_timesteps(3)
    assert np.array_equal(loaded.rf_times, custom.rf_times)


def test_sigma_max_argument_survives_from_config():
    """``RCMScheduler(sigma_max=...)`` (and the teachers' ``sigma_max=`` / ``sigma_min=``) registered the value but
    listed ``rcm_sigma_max`` among diffusers' defaulted keys, so ``from_config(s.config)`` fell back to 80."""
    s = RCMScheduler(sigma_max=200.0)
    assert RCMScheduler.from_config(s.config).sigma_max == 200.0
    assert RCMScheduler.from_config(RCMScheduler(rcm_sigma_max=120.0).config).sigma_max == 120.0
    assert RCMScheduler.from_config(RCMScheduler().config).sigma_max == 80.0
    for cls in (TrigFlowEulerScheduler, TrigFlowUniPCScheduler):
        t = cls.from_config(cls(sigma_max=300.0, sigma_min=0.01).config)
        assert (t.sigma_max, t.config.teacher_sigma_min) == (300.0, 0.01), cls


@pytest.mark.parametrize("cls", [TrigFlowEulerScheduler, TrigFlowUniPCScheduler])
def test_teacher_config_round_trip(cls, tmp_path):
    s = cls.from_config(wan_scheduler_config(), spacing="karras", rho=5.0)
    assert s.effective_shift == 3.0
    s.save_pretrained(tmp_path)
    t = cls.from_pretrained(tmp_path)
    assert t.config.spacing == "karras" and t.config.rho == 5.0 and t.config.flow_shift == 3.0
    s.set_timesteps(6)
    t.set_timesteps(6)
    assert torch.equal(s.sigmas, t.sigmas)


# ----------------------------------------------------------------------------- teacher grids


def test_teacher_linear_grid_shift_and_unshift():
    n, s, smax = 8, 3.0, 5000.0
    r = teacher_rf_grid(n, sigma_max=smax, shift=s)
    r_max = smax / (1 + smax)
    assert len(r) == n + 1 and r[-1] == 0.0 and abs(r[0] - r_max) < 1e-15
    u_max = r_max / (s - (s - 1) * r_max)  # docs/math.md §2.2 un-shifted start
    u = np.linspace(u_max, 0.0, n + 1)
    assert np.allclose(r, s * u / (1 + (s - 1) * u), atol=1e-14)


def test_teacher_karras_and_exponential_grids():
    n, smax, smin, rho = 6, 5000.0, 0.002, 7.0
    i = np.arange(n)
    sig_k = (smax ** (1 / rho) + i / (n - 1) * (smin ** (1 / rho) - smax ** (1 / rho))) ** rho
    assert np.allclose(
        teacher_rf_grid(n, smax, "karras", rho=rho, sigma_min=smin), np.append(sig_k / (1 + sig_k), 0.0), atol=1e-14
    )
    sig_e = np.exp(np.log(smax) + i / (n - 1) * (np.log(smin) - np.log(smax)))
    assert np.allclose(
        teacher_rf_grid(n, smax, "exponential", sigma_min=smin), np.append(sig_e / (1 + sig_e), 0.0), atol=1e-14
    )


def test_teacher_dynamic_shift_uses_mu():
    s = TrigFlowEulerScheduler.from_config(flux_scheduler_config())
    with pytest.raises(ValueError, match="mu"):
        s.set_timesteps(4)
    s.set_timesteps(4, mu=0.7)
    a = math.exp(0.7)
    r_max = 5000 / 5001
    u_max = 1 / (1 + a * (1 / r_max - 1))
    u = np.linspace(u_max, 0, 5)
    assert np.allclose(s.rf_times, np.append(shift_family(u[:-1], a), 0.0), atol=1e-6)
    assert abs(s.rf_times[0] - r_max) < 1e-6


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(sigma_max=-1.0), "sigma_max"),
        (dict(spacing="cosine"), "spacing"),
        (dict(shift=0.0), "shift"),
        (dict(time_shift_type="x"), "time_shift_type"),
    ],
)
def test_teacher_bad_config(kwargs, match):
    with pytest.raises(ValueError, match=match):
        TrigFlowEulerScheduler(**kwargs)


def test_teacher_step_before_set_timesteps():
    for cls in (TrigFlowEulerScheduler, TrigFlowUniPCScheduler):
        with pytest.raises(ValueError, match="set_timesteps"):
            cls().step(torch.zeros(1), 999.0, torch.zeros(1))


# ----------------------------------------------------------------------------- teacher vs diffusers


def _solve(sched, x):
    for i, t in enumerate(sched.timesteps):
        x = sched.step(_velocity(x, float(sched.sigmas[i])), t, x).prev_sample
    return x


@pytest.mark.parametrize("n", [4, 10, 25])
def test_trigflow_euler_matches_flowmatch_euler(n):
    ref = FlowMatchEulerDiscreteScheduler(shift=3.0)
    ref.set_timesteps(n)
    ours = TrigFlowEulerScheduler()
    ours.set_timesteps(sigmas=ref.sigmas[:-1])
    x = torch.randn(2, 4, 8, 8, generator=torch.Generator().manual_seed(n))
    a, b = _solve(ref, x.clone()), _solve(ours, x.clone())
    assert ((a - b).norm() / a.norm()).item() <= 1e-5
    # and our own config grid equals diffusers' once both start at the same point
    u = np.linspace(1.0, 0.0, n + 1)
    ref.set_timesteps(sigmas=u[:-1])
    ours_cfg = TrigFlowEulerScheduler(sigma_max=1e12, shift=3.0)
    ours_cfg.set_timesteps(n)
    assert np.allclose(ours_cfg.rf_times, ref.sigmas.double().numpy(), atol=1e-6)


@pytest.mark.parametrize("order, n", [(2, 8), (3, 12), (2, 30)])
def test_trigflow_unipc_matches_diffusers_unipc(order, n):
    ref = UniPCMultistepScheduler(
        prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=3.0, solver_order=order
    )
    ref.set_timesteps(n)
    ours = TrigFlowUniPCScheduler(solver_order=order)
    ours.set_timesteps(sigmas=ref.sigmas[:-1])
    x = torch.randn(2, 4, 8, 8, generator=torch.Generator().manual_seed(n))
    a, b = _solve(ref, x.clone()), _solve(ours, x.clone())
    assert ((a - b).norm() / a.norm()).item() <= 1e-5


def test_teacher_solvers_converge_on_linear_flow():
    """On v = eps - x0 with a fixed pair, every grid lands exactly on x0 (straight RF paths)."""
    g = torch.Generator().manual_seed(0)
    x0, eps = torch.randn(1, 3, 4, 4, generator=g), torch.randn(1, 3, 4, 4, generator=g)
    for cls in (TrigFlowEulerScheduler, TrigFlowUniPCScheduler):
        for spacing in ("linear", "karras", "exponential"):
            s = cls(spacing=spacing, shift=3.0)
            s.set_timesteps(7)
            x = (1 - s.sigmas[0]) * x0 + s.sigmas[0] * eps
            for t in s.timesteps:
                x = s.step(eps - x0, t, x).prev_sample
            assert torch.allclose(x, x0, atol=1e-5), (cls.__name__, spacing)


# ----------------------------------------------------------------------------- stock configs

# the configs the model repos ship (written by older diffusers; keys as in their scheduler_config.json)
WAN21_UNIPC = {
    "_class_name": "UniPCMultistepScheduler",
    "_diffusers_version": "0.33.0.dev0",
    "beta_end": 0.02,
    "beta_schedule": "linear",
    "beta_start": 0.0001,
    "disable_corrector": [],
    "dynamic_thresholding_ratio": 0.995,
    "final_sigmas_type": "zero",
    "flow_shift": 3.0,
    "lower_order_final": True,
    "num_train_timesteps": 1000,
    "predict_x0": True,
    "prediction_type": "flow_prediction",
    "rescale_betas_zero_snr": False,
    "sample_max_value": 1.0,
    "solver_order": 2,
    "solver_p": None,
    "solver_type": "bh2",
    "steps_offset": 0,
    "thresholding": False,
    "timestep_spacing": "linspace",
    "trained_betas": None,
    "use_beta_sigmas": False,
    "use_exponential_sigmas": False,
    "use_flow_sigmas": True,
    "use_karras_sigmas": False,
}
WAN22_UNIPC = {**WAN21_UNIPC, "flow_shift": 5.0, "_diffusers_version": "0.35.0.dev0"}
FLUX_DEV_FME = {
    "_class_name": "FlowMatchEulerDiscreteScheduler",
    "_diffusers_version": "0.30.0.dev0",
    "base_image_seq_len": 256,
    "base_shift": 0.5,
    "max_image_seq_len": 4096,
    "max_shift": 1.15,
    "num_train_timesteps": 1000,
    "shift": 3.0,
    "use_dynamic_shifting": True,
}
FLUX_SCHNELL_FME = {**FLUX_DEV_FME, "shift": 1.0, "use_dynamic_shifting": False}

STOCK_CONFIGS = [
    ("wan21", UniPCMultistepScheduler, WAN21_UNIPC),
    ("wan22", UniPCMultistepScheduler, WAN22_UNIPC),
    ("unipc-karras", UniPCMultistepScheduler, {**WAN21_UNIPC, "use_karras_sigmas": True}),
    (
        "unipc-karras-smax",
        UniPCMultistepScheduler,
        {**WAN21_UNIPC, "use_karras_sigmas": True, "sigma_max": 20.0, "sigma_min": 0.01},
    ),
    ("flux-dev", FlowMatchEulerDiscreteScheduler, FLUX_DEV_FME),
    ("flux-schnell", FlowMatchEulerDiscreteScheduler, FLUX_SCHNELL_FME),
    ("fme-shift3", FlowMatchEulerDiscreteScheduler, {"shift": 3.0}),
    ("fme-karras", FlowMatchEulerDiscreteScheduler, {"shift": 3.0, "use_karras_sigmas": True}),
    ("fme-exponential", FlowMatchEulerDiscreteScheduler, {"shift": 3.0, "use_exponential_sigmas": True}),
    ("fme-beta", FlowMatchEulerDiscreteScheduler, {"shift": 3.0, "use_beta_sigmas": True}),
    ("fme-terminal", FlowMatchEulerDiscreteScheduler, {"shift": 3.0, "shift_terminal": 0.1, "invert_sigmas": False}),
    ("fme-linear-shift", FlowMatchEulerDiscreteScheduler, {**FLUX_DEV_FME, "time_shift_type": "linear"}),
]


def _saved_config(sched, path):
    """A config as the installed diffusers writes it: save_pretrained, then read the json back."""
    sched.save_pretrained(path)
    return type(sched).load_config(path)


def _grid(sched, n):
    kw = {"mu": 0.8} if sched.config.get("use_dynamic_shifting") else {}
    sched.set_timesteps(n, **kw)
    return sched.sigmas.clone(), sched.timesteps.clone()


@pytest.mark.parametrize("name, stock_cls, cfg", STOCK_CONFIGS, ids=[c[0] for c in STOCK_CONFIGS])
@pytest.mark.parametrize("ours_cls", [RCMScheduler, TrigFlowEulerScheduler, TrigFlowUniPCScheduler])
def test_stock_config_round_trip_is_lossless(name, stock_cls, cfg, ours_cls, tmp_path):
    """stock -> save -> ours (sigma_max overridden) -> save -> stock: the same config keys and the same grid."""
    stock = stock_cls.from_config({k: v for k, v in cfg.items() if not k.startswith("_")})
    saved = _saved_config(stock, tmp_path / "stock")
    ours = ours_cls.from_config(saved, sigma_max=200.0)
    assert ours.sigma_max == 200.0
    ours.set_timesteps(
        4 if ours_cls is RCMScheduler else 6, **({"mu": 0.8} if ours.config.get("use_dynamic_shifting") else {})
    )
    back = stock_cls.from_config(_saved_config(ours, tmp_path / "ours"))
    for key in stock_cls._get_init_keys(stock_cls) - {"self"}:
        assert back.config.get(key) == stock.config.get(key), key
    for key in ("sigma_max", "sigma_min"):  # read by stock schedulers with hasattr(config, ...)
        assert back.config.get(key) == stock.config.get(key), key
    for n in (4, 10):
        a, b = _grid(stock, n), _grid(back, n)
        assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


def test_legacy_config_keys_still_load(tmp_path):
    """Configs written by earlier versions (``sigma_max`` as our own key, ``use_flow_sigmas``) load as before."""
    import json

    legacy = {
        "_class_name": "RCMScheduler",
        "sigma_max": 200.0,
        "mid_t": [1.5, 1.0],
        "stochastic": False,
        "use_flow_sigmas": True,
    }
    (tmp_path / "scheduler_config.json").write_text(json.dumps(legacy))
    s = RCMScheduler.from_pretrained(tmp_path)
    assert s.sigma_max == 200.0 and s.config.stochastic is False and "use_flow_sigmas" not in s.config
    import rcm_diffusers  # the shipped digits teacher's scheduler config is a legacy one

    teacher = TrigFlowEulerScheduler.from_pretrained(
        rcm_diffusers.__path__[0] + "/digits/assets/digits_teacher/scheduler"
    )
    assert teacher.sigma_max == 5000.0 and teacher.config.teacher_sigma_min == 0.002
    with pytest.raises(ValueError, match="not both"):
        RCMScheduler.from_config(RCMScheduler().config, sigma_max=10.0, rcm_sigma_max=20.0)


def test_compatibles_are_truthful():
    for cls in (RCMScheduler, TrigFlowEulerScheduler, TrigFlowUniPCScheduler):
        names = {c.__name__ for c in cls().compatibles}
        assert {"RCMScheduler", "TrigFlowEulerScheduler", "TrigFlowUniPCScheduler"} <= names
        assert {"FlowMatchEulerDiscreteScheduler", "UniPCMultistepScheduler"} <= names
        for c in cls().compatibles:  # each listed class really builds from this config
            c.from_config(cls().config)


# ----------------------------------------------------------------------------- bad input


@pytest.mark.parametrize(
    "kwargs, match", [(dict(solver_type="bh1"), "bh2"), (dict(lower_order_final=False), "lower_order_final")]
)
def test_unipc_nan_settings_refused(kwargs, match):
    """diffusers' UniPC returns NaN at the final zero sigma with these settings; refused up front."""
    ref = UniPCMultistepScheduler(
        prediction_type="flow_prediction", use_flow_sigmas=True, final_sigmas_type="zero", **kwargs
    )
    ref.set_timesteps(5)
    x = torch.randn(1, 4, generator=torch.Generator().manual_seed(0))
    assert not torch.isfinite(_solve(ref, x)).all()  # the inherited failure the check guards against
    with pytest.raises(ValueError, match=match):
        TrigFlowUniPCScheduler(**kwargs)
    TrigFlowUniPCScheduler(solver_order=1, lower_order_final=False)  # first order has no such division


@pytest.mark.parametrize("cls", [RCMScheduler, TrigFlowEulerScheduler, TrigFlowUniPCScheduler])
def test_zero_step_grid_refused(cls):
    s = cls()
    for bad in ([0.0], [0], torch.tensor([0.0])):
        with pytest.raises(ValueError, match="zero steps"):
            s.set_timesteps(sigmas=bad)
    with pytest.raises(ValueError, match="zero steps"):
        s.set_timesteps(timesteps=[0.0])


@pytest.mark.parametrize("cls", [TrigFlowEulerScheduler, TrigFlowUniPCScheduler])
def test_teacher_refuses_nan_model_output(cls):
    s = cls()
    s.set_timesteps(3)
    x = torch.zeros(1, 4)
    with pytest.raises(ValueError, match="NaN or inf"):
        s.step(torch.full_like(x, float("nan")), s.timesteps[0], x)
    s.set_timesteps(3)
    out = s.step(torch.ones_like(x), s.timesteps[0], x).prev_sample
    assert torch.isfinite(out).all()


def test_mid_t_as_comma_separated_string():
    s = RCMScheduler(mid_t="1.5,1.4")
    assert list(s.config.mid_t) == [1.5, 1.4]
    s.set_timesteps(3)
    ref = RCMScheduler(mid_t=[1.5, 1.4])
    ref.set_timesteps(3)
    assert np.array_equal(s.rf_times, ref.rf_times)
    assert list(RCMScheduler.from_config(RCMScheduler().config, mid_t=" 1.2 , 0.8 ").config.mid_t) == [1.2, 0.8]
    for bad in ("1.5;1.4", "a,b"):
        with pytest.raises(ValueError, match="comma-separated"):
            RCMScheduler(mid_t=bad)
    with pytest.raises(ValueError, match="time_input"):
        RCMScheduler(time_input="fp16")


# ----------------------------------------------------------------------------- mid_t per step count

PER_STEP = {2: [1.0], 4: [1.5, 1.4, 0.8]}
PER_STEP_TEXT = "2: 1.0; 4: 1.5, 1.4, 0.8"
#: the angles each step count must use with PER_STEP, written out by hand (3 steps: the 4-step entry cut to 2)
PER_STEP_ANGLES = {1: [], 2: [1.0], 3: [1.5, 1.4], 4: [1.5, 1.4, 0.8]}


def _rf64(angles, sigma_max=80.0):
    t = np.array([math.atan(sigma_max), *angles, 0.0], dtype=np.float64)
    r = np.sin(t) / (np.sin(t) + np.cos(t))
    r[-1] = 0.0
    return r


def test_mid_t_for_steps_resolution():
    from rcm_diffusers.sampling import mid_t_for_steps, rcm_angles

    for n, angles in PER_STEP_ANGLES.items():
        assert mid_t_for_steps(PER_STEP, n) == angles, n
        assert mid_t_for_steps(PER_STEP_TEXT, n) == angles, n
        assert mid_t_for_steps({"4": [1.5, 1.4, 0.8], "2": [1.0]}, n) == angles, n  # JSON keys, any order
        assert np.array_equal(rcm_angles(n, 80.0, PER_STEP), [math.atan(80.0), *angles, 0.0]), n
    # no entry for n: the next larger key, cut to n - 1 angles; an entry longer than its key needs
    assert [mid_t_for_steps({5: [1.5, 1.3, 1.1, 0.9]}, n) for n in (1, 2, 3, 5)] == [
        [],
        [1.5],
        [1.5, 1.3],
        [1.5, 1.3, 1.1, 0.9],
    ]
    assert mid_t_for_steps({2: [1.2, 0.6]}, 2) == [1.2]
    # a flat list L is {len(L) + 1: L}
    flat = [1.5, 1.4, 1.0]
    for n in range(1, 5):
        assert mid_t_for_steps(flat, n) == mid_t_for_steps({4: flat}, n) == flat[: n - 1]
        assert np.array_equal(rcm_angles(n, 80.0, flat), rcm_angles(n, 80.0, {4: flat}))


@pytest.mark.parametrize(
    "mid_t", [PER_STEP, PER_STEP_TEXT, {"2": [1.0], "4": [1.5, 1.4, 0.8]}, {4: (1.5, 1.4, 0.8), 2: 1.0}]
)
def test_per_step_mid_t_scheduler_rf_times(mid_t):
    """The RF times of a per-step RCMScheduler are exactly sin t / (sin t + cos t) of the hand-written angles; the
    config holds the JSON form (string keys, float lists) whatever form was passed."""
    s = RCMScheduler(mid_t=mid_t)
    assert s.config.mid_t == {"2": [1.0], "4": [1.5, 1.4, 0.8]}
    for n, angles in PER_STEP_ANGLES.items():
        s.set_timesteps(n)
        assert np.array_equal(s.rf_times, _rf64(angles)), n


def test_per_step_entry_is_used():
    """2 steps take the 2-step entry (1.0), not the 4-step list's first angle (1.5) as a flat mid_t would."""
    per_step, flat = RCMScheduler(mid_t=PER_STEP), RCMScheduler(mid_t=[1.5, 1.4, 0.8])
    per_step.set_timesteps(2)
    flat.set_timesteps(2)
    assert per_step.rf_times[1] == _rf(1.0) and flat.rf_times[1] == _rf(1.5)
    per_step.set_timesteps(4)
    flat.set_timesteps(4)
    assert np.array_equal(per_step.rf_times, flat.rf_times)


def test_per_step_mid_t_save_load_and_from_config_round_trip(tmp_path):
    s = RCMScheduler(sigma_max=200.0, mid_t=PER_STEP_TEXT, time_input="float")
    s.save_pretrained(tmp_path)
    loaded = RCMScheduler.from_pretrained(tmp_path)
    again = RCMScheduler.from_config(s.config)
    for other in (loaded, again):
        assert other.config.mid_t == {"2": [1.0], "4": [1.5, 1.4, 0.8]}
        assert {k: v for k, v in other.config.items() if k != "_use_default_values"} == {
            k: v for k, v in s.config.items() if k != "_use_default_values"
        }
        for n, angles in PER_STEP_ANGLES.items():
            other.set_timesteps(n)
            assert np.array_equal(other.rf_times, _rf64(angles, 200.0)), n
    # saved again from the loaded one: the same file
    loaded.save_pretrained(tmp_path / "again")
    assert (tmp_path / "again" / "scheduler_config.json").read_text() == (
        tmp_path / "scheduler_config.json"
    ).read_text()
    # over a stock config: its keys kept, the mapping taken
    wan = RCMScheduler.from_config(wan_scheduler_config(), mid_t=PER_STEP)
    assert wan.config.flow_shift == 3.0 and wan.config.mid_t == {"2": [1.0], "4": [1.5, 1.4, 0.8]}
    # a flat list stays a flat list
    assert RCMScheduler.from_config(RCMScheduler(mid_t="1.5,1.4").config).config.mid_t == [1.5, 1.4]


def test_mid_t_text_forms():
    from rcm_diffusers.sampling import format_mid_t, mid_t_as_config, parse_mid_t

    assert parse_mid_t(PER_STEP_TEXT) == PER_STEP == parse_mid_t(" 4 : 1.5,1.4,0.8 ; 2:1.0 ; ")
    assert parse_mid_t("1.5,1.4,1.0") == [1.5, 1.4, 1.0]  # the flat string form as before
    assert format_mid_t(PER_STEP) == PER_STEP_TEXT and parse_mid_t(format_mid_t(PER_STEP)) == PER_STEP
    assert format_mid_t([1.5, 1.4, 1.0]) == "1.5, 1.4, 1.0" and parse_mid_t(format_mid_t([0.8, 0.5])) == [0.8, 0.5]
    assert mid_t_as_config(PER_STEP_TEXT) == {"2": [1.0], "4": [1.5, 1.4, 0.8]}
    assert list(mid_t_as_config({10: [1.5] * 9, 3: "1.2, 0.6"})) == ["3", "10"]  # ascending step counts


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(mid_t={1: [1.0]}), r"^mid_t key 1 is not a step count: keys are whole numbers >= 2"),
        (dict(mid_t={"x": [1.0]}), r"^mid_t key 'x' is not a step count"),
        (dict(mid_t={2.5: [1.0]}), r"^mid_t key 2.5 is not a step count"),
        (dict(mid_t={True: [1.0]}), r"^mid_t key True is not a step count"),
        (
            dict(mid_t={4: [1.5, 1.4]}),
            r"^mid_t entry for 4 steps has 2 angle\(s\) \[1.5, 1.4\]; 4 steps need at least 3",
        ),
        (dict(mid_t="2: 1.0; 2: 0.9"), r"^mid_t gives angles for 2 steps twice"),
        (dict(mid_t={}), r"^mid_t is an empty mapping"),
        (dict(mid_t="2: 1.0; 1.4"), r"^mid_t='2: 1.0; 1.4': entry '1.4' has no step count"),
        (
            dict(mid_t="2: 1.0; 4: 1.5, x, 0.8"),
            r"^mid_t entry for 4 steps: ' 1.5, x, 0.8' is not a comma-separated list",
        ),
        (dict(mid_t={2: [float("nan")]}), r"^mid_t entry for 2 steps holds \[nan\]; angles must be finite"),
        (
            dict(mid_t={2: [1.0], 4: [1.4, 1.5, 0.8]}),
            r"^rCM angles must be strictly decreasing.* in the mid_t entry for 4 steps",
        ),
        (
            dict(mid_t={2: [1.0], 4: [1.6, 1.4, 0.8]}),
            r"^mid_t angles must lie strictly inside \(0, pi/2\), got \[1.6, 1.4, 0.8\] in the mid_t entry for 4 steps",
        ),
        # every entry is checked against sigma_max, also one a 2-step run would not use
        (
            dict(sigma_max=10.0, mid_t=PER_STEP),
            r"^rCM angles .* in the mid_t entry for 4 steps \(arctan\(sigma_max=10.0\)",
        ),
        (dict(mid_t={2: [1.0], 3: [1.2, 0.5, 1.3]}), r"in the mid_t entry for 3 steps"),  # its unused third angle too
    ],
)
def test_per_step_mid_t_errors_are_one_line(kwargs, match):
    with pytest.raises(ValueError, match=match) as e:
        RCMScheduler(**kwargs)
    assert "\n" not in str(e.value)


def test_per_step_mid_t_too_many_steps_names_the_step_counts():
    s = RCMScheduler(mid_t=PER_STEP)
    with pytest.raises(
        ValueError,
        match=r"^num_inference_steps=5 is out of range for the rCM sampler with mid_t="
        r"\{2: \[1.0\], 4: \[1.5, 1.4, 0.8\]\}: it has angles for 2, 4 steps .*"
        r"pass 1..4 steps, or add an entry for 5 steps to mid_t.$",
    ) as e:
        s.set_timesteps(5)
    assert "\n" not in str(e.value)
    with pytest.raises(ValueError, match=r"^num_inference_steps=0 is out of range.*pass 1..4 steps.$"):
        s.set_timesteps(0)


def test_explicit_times_replaced_before_use_are_refused():
    """README's old pattern: set_timesteps(sigmas=...) then a pipeline's own set_timesteps(n) would drop them."""
    s = RCMScheduler()
    s.set_timesteps(sigmas=[0.9, 0.5])
    with pytest.raises(ValueError, match="replaced before any step"):
        s.set_timesteps(2)
    s.set_timesteps(2)  # refused once; the scheduler is usable again
    s.set_timesteps(sigmas=[0.9, 0.5])
    x = torch.zeros(1, 2)
    s.step(x, s.timesteps[0], x)
    s.set_timesteps(4)  # the explicit grid was used: a new run may use another grid


def test_rcm_config_for_rf_times_reproduces_the_times():
    from rcm_diffusers.sampling import rcm_config_for_rf_times

    times = [0.95, 0.8, 0.5, 0.2]
    s = RCMScheduler(**rcm_config_for_rf_times(times))
    s.set_timesteps(4)
    assert np.allclose(s.rf_times, times + [0.0], rtol=0, atol=1e-14)
    with pytest.raises(ValueError, match="< 1"):
        rcm_config_for_rf_times([1.0, 0.5])


def test_flux_default_linspace_means_step_count():
    """FluxPipeline passes sigmas=linspace(1, 1/n, n) when the user gave none: read as n steps."""
    for cls in (RCMScheduler, TrigFlowEulerScheduler):
        s = cls()
        s.set_timesteps(sigmas=np.linspace(1.0, 1 / 4, 4))
        ref = cls()
        ref.set_timesteps(4)
        assert np.array_equal(s.rf_times, ref.rf_times)


def test_scale_noise_uses_the_exact_time_of_a_rounded_grid_timestep():
    s = RCMScheduler()
    s.set_timesteps(4)
    x0, noise = torch.zeros(1, 3, dtype=torch.float64), torch.ones(1, 3, dtype=torch.float64)
    # timesteps[1] = 932 (bf16), the RF time is 0.93378...: img2img starts at the exact time
    assert float(s.scale_noise(x0, s.timesteps[1], noise)[0, 0]) == pytest.approx(s.rf_times[1], abs=1e-15)
    assert float(s.scale_noise(x0, torch.tensor([500.0]), noise)[0, 0]) == pytest.approx(0.5, abs=1e-15)  # off the grid
