"""Non-negative least squares (Lawson and Hanson, "Solving Least Squares Problems", 1974, ch. 23).

Pure numpy, so the controller needs no scipy. `nnls(A, y)` returns θ ≥ 0 minimising ‖Aθ − y‖₂.
`fit_relative(A, y, prior, weight)` is what the cost model uses: it minimises the *relative*
error Σ ((a_i·θ − y_i)/y_i)² (so that a 50 ms stage and a 50 s stage count alike, as
the calibration asks) plus a pull `weight`·‖θ − prior‖² toward the prior coefficients, which keeps
coefficients that the observations do not determine (a term that is zero in every row) at
their calibrated values instead of wherever the solver leaves them. Both terms stack into one
NNLS problem: [A/y; √w·I] θ ≈ [1; √w·prior].
"""

from __future__ import annotations

from typing import Optional

import numpy as np


def nnls(matrix: np.ndarray, target: np.ndarray, max_iterations: Optional[int] = None,
         tolerance: float = 1e-10) -> np.ndarray:
    """θ ≥ 0 minimising ‖matrix·θ − target‖₂ (Lawson–Hanson active-set method).

    Input: matrix [m, n], target [m]. Output: θ [n], every entry ≥ 0. Invariant (KKT): for
    the returned θ, the gradient w = matrixᵀ(target − matrix·θ) is ≤ tolerance wherever θ = 0
    and ≈ 0 wherever θ > 0.
    """
    a = np.asarray(matrix, dtype=float)
    b = np.asarray(target, dtype=float)
    m, n = a.shape
    theta = np.zeros(n)
    passive = np.zeros(n, dtype=bool)
    scale = max(1.0, float(np.abs(a).max(initial=0.0)) * max(1.0, float(np.abs(b).max(initial=0.0))))
    tol = tolerance * scale
    limit = max_iterations or 3 * n + 30
    gradient = a.T @ (b - a @ theta)
    for _ in range(limit):
        if passive.all() or gradient[~passive].max(initial=-np.inf) <= tol:
            break
        candidate = np.where(~passive, gradient, -np.inf)
        passive[int(np.argmax(candidate))] = True
        while True:
            z = np.zeros(n)
            z[passive] = np.linalg.lstsq(a[:, passive], b, rcond=None)[0]
            if z[passive].min() > 0:
                theta = z
                break
            # step back toward the old θ until the first passive coefficient reaches zero
            negative = passive & (z <= 0)
            alpha = np.min(theta[negative] / (theta[negative] - z[negative]))
            theta = theta + alpha * (z - theta)
            passive &= theta > tol
            theta[~passive] = 0.0
        gradient = a.T @ (b - a @ theta)
    return theta


def fit_relative(features: np.ndarray, seconds: np.ndarray, prior: np.ndarray,
                 prior_weight: float = 1e-3) -> np.ndarray:
    """θ ≥ 0 minimising Σ_i ((features_i·θ − seconds_i)/seconds_i)² + prior_weight·‖θ − prior‖².

    Input: features [m, n] (each column a term of the latency formula, in seconds at θ = 1),
    seconds [m] (measured, > 0), prior [n] (≥ 0). Output: θ [n] ≥ 0. With no rows the
    result is the prior.
    """
    x = np.asarray(features, dtype=float).reshape(-1, len(prior))
    y = np.asarray(seconds, dtype=float)
    prior = np.asarray(prior, dtype=float)
    if len(y) == 0:
        return prior.copy()
    rows = x / y[:, None]
    ones = np.ones(len(y))
    root = np.sqrt(prior_weight)
    stacked = np.vstack([rows, root * np.eye(len(prior))])
    target = np.concatenate([ones, root * prior])
    return nnls(stacked, target)


def relative_errors(features: np.ndarray, seconds: np.ndarray, theta: np.ndarray) -> np.ndarray:
    """(features·θ − seconds)/seconds per row."""
    y = np.asarray(seconds, dtype=float)
    return (np.asarray(features, dtype=float) @ theta - y) / y


def leave_one_out_error(features: np.ndarray, seconds: np.ndarray, prior: np.ndarray,
                        prior_weight: float = 1e-3, max_rows: int = 40) -> float:
    """Root-mean-square relative error of each row predicted by a fit on the others (the
    ε of the admission's confidence margin). Uses the last `max_rows` rows to bound the cost;
    returns NaN with fewer than 2 rows."""
    x = np.asarray(features, dtype=float)[-max_rows:]
    y = np.asarray(seconds, dtype=float)[-max_rows:]
    if len(y) < 2:
        return float("nan")
    errors = []
    for i in range(len(y)):
        keep = np.arange(len(y)) != i
        theta = fit_relative(x[keep], y[keep], prior, prior_weight)
        errors.append((x[i] @ theta - y[i]) / y[i])
    return float(np.sqrt(np.mean(np.square(errors))))
