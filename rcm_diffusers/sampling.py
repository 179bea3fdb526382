"""Time grids of the samplers (docs/math.md §2), as float64 NumPy arrays of RF times ``r`` ending at 0.

These are the single source of the step times: the diffusers schedulers
(``rcm_diffusers.schedulers``) and the ComfyUI nodes (``comfy_nodes``) both call them.
An RF time ``r`` is ComfyUI's CONST-model ``sigma`` and diffusers' flow-matching ``sigma``.
"""

from __future__ import annotations

import math
from numbers import Integral
from typing import Mapping, Sequence

import numpy as np

__all__ = [
    "DEFAULT_MID_T",
    "rcm_angles",
    "rcm_rf_times",
    "parse_mid_t",
    "mid_t_for_steps",
    "validate_mid_t",
    "mid_t_as_config",
    "format_mid_t",
    "rcm_config_for_rf_times",
    "validate_rf_times",
    "shift_family",
    "unshift_family",
    "teacher_rf_grid",
    "SPACINGS",
    "rcm_update",
]

#: Intermediate TrigFlow angles of the few-step sampler (docs/math.md §2.1).
DEFAULT_MID_T = (1.5, 1.4, 1.0)
SPACINGS = ("linear", "karras", "exponential")


def _finite(name: str, value: float) -> float:
    value = float(value)
    if not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value}.")
    return value


_MID_T_EXAMPLE = (
    'e.g. mid_t=[1.5, 1.4, 1.0], "1.5,1.4,1.0", {2: [1.0], 4: [1.5, 1.4, 0.8]} or "2: 1.0; 4: 1.5, 1.4, 0.8"'
)


def _angle_list(value, what: str = "mid_t") -> list[float]:
    """A flat list of angles: a number, a sequence of numbers, or a comma-separated string."""
    if isinstance(value, str):
        parts = [p.strip() for p in value.split(",") if p.strip()]
        try:
            return [float(p) for p in parts]
        except ValueError:
            shown = f"{what}={value!r}" if what == "mid_t" else f"{what}: {value!r}"
            raise ValueError(f"{shown} is not a comma-separated list of angles; {_MID_T_EXAMPLE}.") from None
    try:
        return [float(m) for m in np.asarray(value, dtype=np.float64).reshape(-1)]
    except (TypeError, ValueError):
        raise ValueError(
            f"{what} must be a list of TrigFlow angles (radians), got {value!r}; {_MID_T_EXAMPLE}."
        ) from None


def _steps_key(key) -> int:
    """A per-step-count key: an integer or a string of digits (as JSON gives keys back), >= 2."""
    if isinstance(key, str) and key.strip().isdigit():
        k = int(key.strip())
    elif isinstance(key, Integral) and not isinstance(key, bool):
        k = int(key)
    else:
        k = None
    if k is None or k < 2:
        raise ValueError(
            f"mid_t key {key!r} is not a step count: keys are whole numbers >= 2 (n steps use n - 1 angles, 1 step "
            f"none), e.g. {{2: [1.0], 4: [1.5, 1.4, 0.8]}}."
        )
    return k


def _per_step_items(text: str, label: str = "mid_t={text!r}: entry {entry!r}") -> list[tuple[str, str]]:
    """``"2: 1.0; 4: 1.5, 1.4, 0.8"`` -> ``[("2", "1.0"), ("4", "1.5, 1.4, 0.8")]``; ``label`` (formatted with
    ``text`` and ``entry``) opens the message for an entry without a step count."""
    items = []
    for entry in (e.strip() for e in text.split(";")):
        if not entry:
            continue
        key, sep, angles = entry.partition(":")
        if not sep:
            raise ValueError(
                label.format(text=text, entry=entry) + ' has no step count; write "steps: angles" entries '
                'separated by semicolons, e.g. "2: 1.0; 4: 1.5, 1.4, 0.8".'
            )
        items.append((key, angles))
    return items


def _per_step_table(items) -> dict[int, list[float]]:
    """Checked ``{steps: angles}``: int keys >= 2 in ascending order, each with at least ``steps - 1`` finite angles."""
    table: dict[int, list[float]] = {}
    for key, value in items:
        k = _steps_key(key)
        if k in table:
            raise ValueError(f"mid_t gives angles for {k} steps twice; keep one entry per step count.")
        angles = _angle_list(value, what=f"mid_t entry for {k} steps")
        bad = [a for a in angles if not math.isfinite(a)]
        if bad:
            raise ValueError(f"mid_t entry for {k} steps holds {bad}; angles must be finite numbers.")
        if len(angles) < k - 1:
            raise ValueError(
                f"mid_t entry for {k} steps has {len(angles)} angle(s) {angles}; {k} steps need at least {k - 1}."
            )
        table[k] = angles
    if not table:
        raise ValueError(f"mid_t is an empty mapping; give angles for at least one step count, {_MID_T_EXAMPLE}.")
    return dict(sorted(table.items()))


def parse_mid_t(mid_t) -> list[float] | dict[int, list[float]]:
    """``mid_t`` read: a flat form (a sequence of numbers, or a comma-separated string such as ``"1.5,1.4,1.0"``) gives
    a list of floats; a per-step-count form (a mapping ``{2: [1.0], 4: [1.5, 1.4, 0.8]}`` with int or digit-string
    keys, or a string ``"2: 1.0; 4: 1.5, 1.4, 0.8"``) gives ``{steps: [angles]}`` with int keys in ascending order.
    Checks the mapping's shape (keys >= 2, at least ``key - 1`` finite angles each); the angles' range and order are
    checked by :func:`rcm_angles` and :func:`validate_mid_t`."""
    if isinstance(mid_t, Mapping):
        return _per_step_table(mid_t.items())
    if isinstance(mid_t, str) and ":" in mid_t:
        return _per_step_table(_per_step_items(mid_t))
    return _angle_list(mid_t)


def _resolve(mid_t, num_steps) -> tuple[list[float], int | None]:
    """The ``num_steps - 1`` angles of an ``n``-step run and the mapping key they came from (None for a flat list)."""
    if isinstance(num_steps, bool) or not isinstance(num_steps, (Integral, float)) or int(num_steps) != num_steps:
        raise ValueError(f"num_inference_steps must be an integer, got {num_steps!r}.")
    n = int(num_steps)
    if isinstance(mid_t, dict):
        keys = [k for k in mid_t if k >= n]
        if n < 1 or not keys:
            more = f", or add an entry for {n} steps to mid_t" if n > 1 else ""
            raise ValueError(
                f"num_inference_steps={n} is out of range for the rCM sampler with mid_t={mid_t}: it has angles for "
                f"{', '.join(str(k) for k in mid_t)} steps (each entry also serves fewer steps), so pass "
                f"1..{max(mid_t)} steps{more}."
            )
        return mid_t[keys[0]][: n - 1], keys[0]
    max_steps = len(mid_t) + 1
    if not 1 <= n <= max_steps:
        raise ValueError(
            f"num_inference_steps={n} is out of range for the rCM sampler with mid_t={list(mid_t)}: "
            f"pass 1..{max_steps} steps (e.g. num_inference_steps=4), or give more intermediate angles in mid_t."
        )
    return list(mid_t[: n - 1]), None


def mid_t_for_steps(mid_t, num_steps: int) -> list[float]:
    """The ``n - 1`` intermediate angles an ``n``-step rCM run uses (docs/math.md §2.1).

    Flat list ``L``: ``L[:n-1]`` (``n <= len(L) + 1``). Mapping ``{steps: angles}``: the entry keyed ``n``, else the one
    with the smallest key above ``n``, cut to its first ``n - 1`` angles; a flat ``L`` equals ``{len(L) + 1: L}``.
    ``n = 1`` needs none. ``ValueError`` (naming the step counts available) when no entry serves ``n``."""
    return _resolve(parse_mid_t(mid_t), num_steps)[0]


def validate_mid_t(mid_t, sigma_max: float = 80.0) -> list[float] | dict[int, list[float]]:
    """:func:`parse_mid_t` plus a check of every angle of every entry: finite, strictly decreasing, inside
    ``(0, pi/2)`` and below ``arctan(sigma_max)``. Returns the parsed form."""
    parsed = parse_mid_t(mid_t)
    if isinstance(parsed, dict):
        sigma_max = _check_sigma_max(sigma_max)
        for k, angles in parsed.items():
            _angle_grid(sigma_max, angles, angles, k)
    else:
        rcm_angles(len(parsed) + 1, sigma_max, parsed)
    return parsed


def mid_t_as_config(mid_t) -> list[float] | dict[str, list[float]]:
    """``mid_t`` in its JSON-friendly normal form (what ``RCMScheduler`` registers in its config): a list of floats,
    or ``{"2": [...], "4": [...]}`` with string keys in ascending step order."""
    parsed = parse_mid_t(mid_t)
    if isinstance(parsed, dict):
        return {str(k): list(v) for k, v in parsed.items()}
    return list(parsed)


def format_mid_t(mid_t) -> str:
    """``mid_t`` as text that :func:`parse_mid_t` reads back: ``"1.5, 1.4, 1.0"`` or ``"2: 1.0; 4: 1.5, 1.4, 0.8"``."""
    parsed = parse_mid_t(mid_t)
    if isinstance(parsed, dict):
        return "; ".join(f"{k}: " + ", ".join(repr(a) for a in v) for k, v in parsed.items())
    return ", ".join(repr(a) for a in parsed)


def rcm_config_for_rf_times(rf_times: Sequence[float]) -> dict:
    """``sigma_max`` and ``mid_t`` whose rCM grid is exactly the given RF times ``r_0 > r_1 > ... (> 0)``:
    ``sigma_max = r_0 / (1 - r_0)``, ``mid_t_i = arctan(r_i / (1 - r_i))`` (inverse of docs/math.md §2.1's map).

    Use it to run explicit times inside pipelines that call ``set_timesteps(n)`` themselves:
    ``RCMScheduler.from_config(cfg, **rcm_config_for_rf_times([0.95, 0.8, 0.5]))``, then ``num_inference_steps=3``."""
    r = validate_rf_times(rf_times, name="rf_times")[:-1]
    if r[0] >= 1.0:
        raise ValueError("the first RF time must be < 1 (r = 1 is sigma_max = inf); pass e.g. 0.995.")
    return {"sigma_max": float(r[0] / (1.0 - r[0])), "mid_t": [float(math.atan2(x, 1.0 - x)) for x in r[1:]]}


def _check_sigma_max(sigma_max) -> float:
    sigma_max = _finite("sigma_max", sigma_max)
    if sigma_max <= 0:
        raise ValueError(f"sigma_max must be > 0 (80 for Wan T2V, 200 for Wan I2V), got {sigma_max}.")
    return sigma_max


def _angle_grid(sigma_max: float, angles: list[float], shown, key: int | None) -> np.ndarray:
    """``[arctan(sigma_max), *angles, 0]`` after the range and order checks; ``shown``/``key`` name the source."""
    where = "" if key is None else f" in the mid_t entry for {key} steps"
    t = np.array([math.atan(sigma_max), *angles, 0.0], dtype=np.float64)
    if np.any(t[1:-1] <= 0) or np.any(t[1:-1] >= math.pi / 2):
        raise ValueError(f"mid_t angles must lie strictly inside (0, pi/2), got {list(shown)}{where}.")
    if np.any(np.diff(t) >= 0):
        raise ValueError(
            f"rCM angles must be strictly decreasing, got {t.tolist()}{where} "
            f"(arctan(sigma_max={sigma_max}) = {t[0]:.5f} must exceed mid_t[0]); "
            "pass a strictly decreasing mid_t below arctan(sigma_max)."
        )
    return t


def rcm_angles(num_steps: int, sigma_max: float = 80.0, mid_t=DEFAULT_MID_T) -> np.ndarray:
    """TrigFlow angles ``[arctan(sigma_max), *mid_t_for_steps(mid_t, n), 0]`` of an ``n``-step rCM sampler
    (docs/math.md §2.1); ``mid_t`` is a flat list (``n`` steps use its first ``n - 1``) or a per-step-count mapping."""
    sigma_max = _check_sigma_max(sigma_max)
    parsed = parse_mid_t(mid_t)
    if not isinstance(parsed, dict):
        parsed = [_finite("mid_t entry", m) for m in parsed]
    angles, key = _resolve(parsed, num_steps)
    return _angle_grid(sigma_max, angles, parsed if key is None else parsed[key], key)


def rcm_rf_times(num_steps: int, sigma_max: float = 80.0, mid_t=DEFAULT_MID_T) -> np.ndarray:
    """RF times ``r = sin t / (sin t + cos t)`` of :func:`rcm_angles`, ``n + 1`` values ending at 0 (docs/math.md §2.1);
    ``mid_t`` in any form :func:`parse_mid_t` reads."""
    t = rcm_angles(num_steps, sigma_max, mid_t)
    r = np.sin(t) / (np.sin(t) + np.cos(t))
    r[-1] = 0.0
    return r


def validate_rf_times(r: Sequence[float], append_zero: bool = True, name: str = "sigmas") -> np.ndarray:
    """Check user RF times: finite, strictly decreasing, inside (0, 1]; returns float64 with a final 0."""
    try:
        arr = np.asarray([float(x) for x in np.asarray(r, dtype=np.float64).reshape(-1)], dtype=np.float64)
    except (TypeError, ValueError) as e:
        raise ValueError(f"{name} must be a list of numbers (RF times in (0, 1]), got {r!r}") from e
    if arr.size == 0:
        raise ValueError(f"{name} is empty; pass at least one RF time in (0, 1].")
    if not np.all(np.isfinite(arr)):
        raise ValueError(f"{name} holds NaN or inf: {arr.tolist()}; pass finite RF times in (0, 1].")
    if append_zero and arr[-1] != 0.0:
        arr = np.append(arr, 0.0)
    body = arr[:-1]
    if body.size == 0:
        raise ValueError(
            f"{name}={arr.tolist()} holds no time before the final 0, i.e. zero steps (the output would be the "
            "initial noise); pass at least one RF time in (0, 1], e.g. [0.9, 0.5]."
        )
    if np.any(body <= 0) or np.any(body > 1):
        raise ValueError(
            f"{name} must lie in (0, 1] (RF times, 1 = pure noise) before the final 0, got {arr.tolist()}."
        )
    if np.any(np.diff(arr) >= 0):
        raise ValueError(f"{name} must be strictly decreasing, got {arr.tolist()}.")
    return arr


def shift_family(r, a: float, b: float = 1.0):
    """Time shift ``r' = a / (a + (1/r - 1)^b)`` (docs/math.md §2.2). ``a = s, b = 1`` is ``s r / (1 + (s-1) r)``."""
    r = np.asarray(r, dtype=np.float64)
    with np.errstate(divide="ignore"):
        odds = np.where(r > 0, (1.0 / np.where(r > 0, r, 1.0) - 1.0), np.inf)
    out = a / (a + odds**b)
    return np.where(r <= 0, 0.0, out)


def unshift_family(r_shifted, a: float, b: float = 1.0):
    """Inverse of :func:`shift_family`: ``r = 1 / (1 + (a (1/r' - 1))^(1/b))``."""
    rs = np.asarray(r_shifted, dtype=np.float64)
    with np.errstate(divide="ignore"):
        odds = np.where(rs > 0, 1.0 / np.where(rs > 0, rs, 1.0) - 1.0, np.inf)
    out = 1.0 / (1.0 + (a * odds) ** (1.0 / b))
    return np.where(rs <= 0, 0.0, out)


def teacher_rf_grid(
    num_steps: int,
    sigma_max: float = 5000.0,
    spacing: str = "linear",
    shift: float = 1.0,
    rho: float = 7.0,
    sigma_min: float = 0.002,
    shift_b: float = 1.0,
) -> np.ndarray:
    """Teacher ODE grid (docs/math.md §2.2): ``num_steps + 1`` RF times from ``r_max = sigma_max/(1+sigma_max)`` to 0.

    - ``linear``: ``u`` uniform from the un-shifted start ``unshift(r_max)`` to 0, then
      ``r = shift_family(u, shift, shift_b)`` (``shift_b = 1``: the usual ``s u / (1 + (s-1) u)``), so that the grid
      starts exactly at ``r_max``.
    - ``karras``: ``sigma_i = (smax^(1/rho) + i/(N-1) (smin^(1/rho) - smax^(1/rho)))^rho``, then
      ``r = sigma/(1+sigma)``, final 0.
    - ``exponential``: ``sigma_i`` log-uniform from ``sigma_max`` to ``sigma_min``, final 0.
    ``shift`` applies to ``linear`` only (karras/exponential set their own density).
    """
    sigma_max = _finite("sigma_max", sigma_max)
    if sigma_max <= 0:
        raise ValueError(f"sigma_max must be > 0 (teacher default 5000), got {sigma_max}.")
    if isinstance(num_steps, bool) or int(num_steps) != num_steps or int(num_steps) < 1:
        raise ValueError(f"num_inference_steps must be a positive integer, got {num_steps!r}.")
    n = int(num_steps)
    shift = _finite("shift", shift)
    if shift <= 0:
        raise ValueError(f"shift must be > 0 (Wan 480p uses 3 to 5), got {shift}.")
    r_max = sigma_max / (1.0 + sigma_max)
    if spacing == "linear":
        u_max = float(unshift_family(r_max, shift, shift_b))
        u = np.linspace(u_max, 0.0, n + 1, dtype=np.float64)
        r = shift_family(u, shift, shift_b)
        r[0] = r_max
    elif spacing in ("karras", "exponential"):
        sigma_min = _finite("sigma_min", sigma_min)
        if not 0 < sigma_min < sigma_max:
            raise ValueError(f"need 0 < sigma_min < sigma_max, got sigma_min={sigma_min}, sigma_max={sigma_max}.")
        frac = np.linspace(0.0, 1.0, n, dtype=np.float64) if n > 1 else np.zeros(1)
        if spacing == "karras":
            if rho <= 0:
                raise ValueError(f"rho must be > 0 (7 is the usual), got {rho}.")
            lo, hi = sigma_min ** (1.0 / rho), sigma_max ** (1.0 / rho)
            sig = (hi + frac * (lo - hi)) ** rho
        else:
            sig = np.exp(math.log(sigma_max) + frac * (math.log(sigma_min) - math.log(sigma_max)))
        r = np.append(sig / (1.0 + sig), 0.0)
    else:
        raise ValueError(f"unknown spacing {spacing!r}; choose one of {SPACINGS}.")
    r[-1] = 0.0
    if np.any(np.diff(r) >= 0):
        raise ValueError(f"teacher grid is not strictly decreasing: {r.tolist()}")
    return r


def rcm_update(x, x0, r_cur: float, r_next: float, noise=None, stochastic: bool = True):
    """One rCM sampler move from ``r_cur`` to ``r_next`` given the model's ``x0`` (docs/math.md §2.1).

    Stochastic: ``x' = (1 - r_next) x0 + r_next noise``. Deterministic ("ode"):
    ``x' = x - (r_cur - r_next) v`` with ``v = (x - x0) / r_cur``, i.e.
    ``x' = x0 + (r_next / r_cur)(x - x0)``. At ``r_next = 0`` both return ``x0``.
    Works on torch tensors or NumPy arrays; the caller picks the dtype (float64 for references).
    """
    if r_next == 0:
        return x0
    if stochastic:
        if noise is None:
            raise ValueError("the stochastic rCM update needs fresh noise; pass noise= or use stochastic=False.")
        return (1.0 - r_next) * x0 + r_next * noise
    return x0 + (r_next / r_cur) * (x - x0)
