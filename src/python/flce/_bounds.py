"""The tolerance policy of tests/support/tolerance.h, ported to numpy.

Same sections, same terms, same C = 1; the derivation heads tolerance.h and
is summarized in the README ("Tolerance policy"). The C++ computes the
bounds from a brute force with the whole [N, V] logits in memory; here the
logits and everything derived from them are computed in float64 one block of
rows at a time (about `chunk_elements` logits per block), so memory stays at
O(chunk + V*H) for any N. Time is O(N*V*H), like the oracle itself.

Each function below is the numpy form of the C++ function of the same name;
`pw(p, q)` is p*q with 0*anything = 0 (a class with p = 0 adds nothing).
"""

import math

import numpy as np

# exp, log and tanh: relative error <= KAPPA u, i.e. within 2.5 ulp (an error
# of E ulp is at most 2E u). CUDA's expf and tanhf are documented at 2 ulp from
# the correctly rounded result, libm's tanhf at 2.5; flce's own kernels are
# tighter (tests/support/tolerance.h lists them).
KAPPA = 5.0

UNIT_ROUNDOFF = {"f64": 2.0**-53, "f32": 2.0**-24, "f16": 2.0**-11, "bf16": 2.0**-8}


def gamma(n, u):
    """gamma_n = n u / (1 - n u); +inf once n u >= 1 (no bound exists)."""
    nu = n * u
    return math.inf if nu >= 1.0 else nu / (1.0 - nu)


# The floating formats by unit roundoff: (u, smallest subnormal, smallest
# normal) for f64, f32, f16, bf16; a coarser u takes bf16's range.
_FORMATS = ((2.0**-53, 2.0**-1074, 2.0**-1022), (2.0**-24, 2.0**-149, 2.0**-126),
            (2.0**-11, 2.0**-24, 2.0**-14), (2.0**-8, 2.0**-133, 2.0**-126))


def _format_of(u):
    return next((f for f in _FORMATS if u <= f[0]), _FORMATS[-1])


def tiny(u):
    """Smallest positive subnormal of the format with unit roundoff u."""
    return _format_of(u)[1]


def smallest_normal(u):
    """Smallest positive normal of that format (section 6's p underflow)."""
    return _format_of(u)[2]


def cast_underflow(u):
    """A cast's absolute error below the normal range (section 7): tiny/2,
    or bf16's smallest normal (its dot-product instructions read subnormals
    as 0); 0 without a cast."""
    if u <= 0:
        return 0.0
    return smallest_normal(u) if u == 2.0 ** -8 else tiny(u) / 2


def cast_error(pr, G, dG):
    """dG' of section 7: G's error once cast with u_g (for the GEMMs, or
    a 16-bit grad_logits)."""
    return dG + pr.u_grad * np.abs(G) + cast_underflow(pr.u_grad)


def gemm_input_error(pr, G, dG):
    """dG' as the gradient GEMMs read G: cast_error, plus the smallest normal
    of the accumulation format (they may read G' below it as 0; the cpu
    backend flushes it, as subnormal operands slow its f32 GEMMs ~20x)."""
    return cast_error(pr, G, dG) + smallest_normal(pr.u_accum)


def pw(p, q):
    return np.where(p == 0, 0.0, p * q)


def mul0(a, b):
    """a * b, 0 where either is (tolerance.cpp, mul0)."""
    return np.where((a == 0) | (b == 0), 0.0, a * b)


class Problem:
    """A problem as exact float64 values (what a backend reads after decoding
    its storage). w is kept as [V, H] (vh) whatever the caller's layout."""

    def __init__(self, *, x, w_vh, bias, logits, labels, token_weights, class_weights,
                 grad_loss, grad_lse, grad_entropy, logit_scale, softcap, ignore_index,
                 label_smoothing, z_loss, reduction):
        self.logits_entry = logits is not None
        self.x, self.w, self.bias, self.logits = x, w_vh, bias, logits
        self.labels = labels.astype(np.int64)
        self.n = self.labels.shape[0]
        self.v = (logits if self.logits_entry else w_vh).shape[1 if self.logits_entry else 0]
        self.h = 0 if self.logits_entry else x.shape[1]
        self.t = np.ones(self.n) if token_weights is None else token_weights
        self.c = np.ones(self.v) if class_weights is None else class_weights
        self.grad_loss, self.grad_lse, self.grad_entropy = grad_loss, grad_lse, grad_entropy
        self.a, self.k = float(logit_scale), float(softcap)
        self.e, self.l = float(label_smoothing), float(z_loss)
        self.ignore_index, self.reduction = int(ignore_index), reduction
        self.ignored = self.labels == self.ignore_index
        kept = ~self.ignored
        # D = sum over kept rows of t_i c_{y_i}; r_i = d objective / d loss_i.
        y = np.where(kept, self.labels, 0)
        self.denominator = float(np.sum(np.where(kept, self.t * self.c[y], 0.0)))
        g = 1.0 if grad_loss is None else grad_loss
        if reduction == "mean":
            g = g / self.denominator if self.denominator > 0 else 0.0 * g
        self.loss_coef = np.where(kept, np.broadcast_to(g, (self.n,)), 0.0)


class Precision:
    """u_a, u_s, u_g, u_l, u_q of tolerance.h, u_o per output name, and the
    gradient filter's eps, resolved (0: off)."""

    def __init__(self, u_accum, u_store, u_grad=0.0, u_saved_lse=0.0, u_out=None, u_packed=0.0,
                 filter_eps=0.0):
        self.u_accum, self.u_store = u_accum, u_store
        self.u_grad, self.u_saved_lse = u_grad, u_saved_lse
        self.u_packed = u_packed
        self.u_out = dict(u_out or {})
        self.filter_eps = filter_eps


def _packed_score_errors(s, uq, ua):
    """Section 6's q_ij (tolerance.h): the error of a score read back from a
    16-bit store of its difference from a running max; 0 without one, and
    where s_ij or the row's max is not finite."""
    if uq == 0:
        return np.zeros_like(s)
    m = np.where(np.isnan(s), -np.inf, s).max(axis=1)[:, None]
    ok = np.isfinite(s) & np.isfinite(m)
    with np.errstate(invalid="ignore"):
        q = (uq + 2 * ua) * (m - s) + ua * np.abs(s) + tiny(uq)
    return np.where(ok, q, 0.0)


def _exact_rows(d, rows):
    """Brute force of rows `rows`: z, s, p, logp and the row statistics."""
    if d.logits_entry:
        dot = d.logits[rows]
        mag = np.abs(dot)
    else:
        xb = d.x[rows]
        dot = xb @ d.w.T
        mag = np.abs(xb) @ np.abs(d.w).T
        if d.bias is not None:
            dot = dot + d.bias
            mag = mag + np.abs(d.bias)
    z = d.a * dot
    s = d.k * np.tanh(z / d.k) if d.k > 0 else z
    nan = np.isnan(s)
    any_nan = nan.any(axis=1)
    first_nan = np.argmax(nan, axis=1)
    best = np.argmax(np.where(nan, -np.inf, s), axis=1)  # lowest index of the max
    argmax = np.where(any_nan, first_nan, best)
    m = np.where(nan, -np.inf, s).max(axis=1)
    finite_m = np.where(np.isinf(m), 0.0, m)
    lse_m = np.log(np.exp(s - finite_m[:, None]).sum(axis=1))
    lse = finite_m + lse_m
    lse = np.where(np.isinf(m), m, lse)
    lse = np.where(any_nan, np.nan, lse)
    # (s - m) - log sum where m is finite, as the C++ brute force: s - lse
    # would lose log sum to lse's rounding at a large m (a row of -1e30).
    shifted = (np.isfinite(m) & ~any_nan)[:, None]
    logp = np.where(shifted, (s - finite_m[:, None]) - lse_m[:, None], s - lse[:, None])
    p = np.exp(logp)
    mu = pw(p, s).sum(axis=1)
    return dict(z=z, s=s, m_abs=mag, argmax=argmax, lse=lse, logp=logp, p=p, mu=mu,
                entropy=lse - mu, zloss=d.l * lse * lse)


def _logit_bounds(d, ex, pr):
    """Section 1: ds_ij, and max_j ds_ij (narrowed to Delta_i in block_bounds)."""
    ua, us = pr.u_accum, pr.u_store
    g_dot = gamma(2.0 if d.logits_entry else d.h + 3.0, ua)
    z, s, mag = ex["z"], ex["s"], ex["m_abs"]
    dz = d.a * g_dot * mag
    if d.k > 0:
        tt = np.tanh(np.maximum(0.0, np.abs(z) - dz) / d.k)
        ds = (1.0 - tt * tt) * dz + ((KAPPA + 4.0) * ua + us) * np.abs(s)
    else:
        ds = dz + us * np.abs(s)
    # +-inf logits are exact; under a softcap s = +-k carries k's conversion
    # and storage.
    ds = np.where(np.isinf(z) & ~np.isnan(mag), (ua + us) * d.k if d.k > 0 else 0.0, ds)
    return ds, ds.max(axis=1)


def _p_expm1(logp, p, x):
    """p (e^x - 1) for x >= 0 without cancellation (tolerance.cpp, p_expm1)."""
    small = x <= 1.0
    return np.where(small, pw(p, np.expm1(np.where(small, x, 0.0))), np.exp(logp + x) - p)


def _p_error(logp, p, rel_p, p_max):
    """dp: how far the gradient pass's p can be from p, given p's error as a
    logarithm: p e^{rel_p} - p, at most p_max (tolerance.cpp, p_error)."""
    e = np.where(logp == -np.inf, 0.0, _p_expm1(logp, p, rel_p))  # s = -inf, or lse = +inf: p is 0 exactly
    return np.where(np.isnan(e), e, np.fmin(e, p_max))  # a NaN p_max (lse = inf) caps nothing


def _p_max(q, s, lse, ev, k, pr):
    """The largest p the gradient pass can compute (tolerance.cpp, p_max)."""
    ua = pr.u_accum
    recomputed = 2.0 * (KAPPA + 4.0) * ua * np.abs(s) if k > 0 else 0.0
    return np.exp(q + ((ua + pr.u_saved_lse) * np.abs(lse) + ev)[:, None]
                  + 2.0 * ua * (np.abs(s) + np.abs(lse)[:, None]) + recomputed) * (1.0 + KAPPA * ua)


def _lse_logit_error(logp, p, ds, max_ds):
    """Delta_i: how far lse_i moves when every s_ij moves by up to ds_ij,
    log1p(sum_j p_ij expm1(ds_ij)) (tolerance.cpp, lse_logit_error): at most
    max_j ds_ij, and not set by a class whose p is 0 (a vocabulary padding
    masked by a logit of -1e30)."""
    r = np.log1p(_p_expm1(logp, p, ds).sum(axis=1))
    return np.where(np.isnan(r), max_ds, np.minimum(max_ds, r))


def block_bounds(d, pr, rows, want_grads):
    """Sections 1-6 for the rows `rows` (a slice). Returns the exact values
    and bounds the later sections and the caller need."""
    ua = pr.u_accum
    v, log_v = d.v, math.log(d.v)
    out = {}
    ex = _exact_rows(d, rows)
    s, p, logp, lse, mu = ex["s"], ex["p"], ex["logp"], ex["lse"], ex["mu"]
    floor_a = (d.n + d.v + d.h + 8) * tiny(ua)
    ds, max_ds = _logit_bounds(d, ex, pr)
    delta = _lse_logit_error(logp, p, ds, max_ds)

    # Section 2: lse.
    gv, gv1, gv5 = gamma(v, ua), gamma(v + 1.0, ua), gamma(v + 5.0, ua)
    ev = (gv + (v + 1.0) * (KAPPA + 1.0) * ua + 3.0 * ua * log_v
          + ua * (np.abs(lse) + log_v) + 2.0 * ua * d.k + KAPPA * ua * log_v
          + ua * np.abs(lse) + pr.u_saved_lse * np.abs(lse))
    dlse = delta + ev
    out["lse"] = dlse

    # Section 3: logp and p.
    rho = 2.0 * ua * (np.abs(s) + np.abs(lse)[:, None] + log_v)
    dlogp = ds + dlse[:, None] + rho
    # p's error as a logarithm (_p_error: how far p itself can move).
    relp = dlogp + KAPPA * ua + ua * (np.abs(s) + np.abs(lse)[:, None])

    # Section 4: entropy.
    from_logits = pw(p, np.abs(s - mu[:, None]) * ds).sum(axis=1)
    mag = pw(p, np.abs(s) + np.abs(logp))
    w = mag.sum(axis=1)
    evaluation = pw(mag, rho + KAPPA * ua + gv1).sum(axis=1)
    out["entropy"] = from_logits + ev * (1.0 + w) + evaluation + ua * (np.abs(lse) + np.abs(mu))

    # Section 5: ce, z-loss, loss rows.
    labels, ignored = d.labels[rows], d.ignored[rows]
    y = np.where(ignored, 0, labels)
    at = np.arange(y.shape[0])
    e, l = d.e, d.l
    cy = np.where(ignored, 0.0, d.c[y])
    logp_y = logp[at, y]
    out["logprob"] = np.where(ignored, 0.0, dlogp[at, y])
    dzl = 2.0 * l * np.abs(lse) * dlse + 3.0 * ua * l * lse * lse
    out["zloss"] = dzl
    dce = (1.0 - e) * cy * dlogp[at, y]
    magnitude = (1.0 - e) * cy * np.abs(logp_y)
    ce = -(1.0 - e) * cy * logp_y
    if e > 0:
        dce = dce + e / v * (d.c * dlogp).sum(axis=1)
        magnitude = magnitude + e / v * (d.c * (np.abs(s) + np.abs(lse)[:, None])).sum(axis=1)
        ce = ce - e / v * (d.c * logp).sum(axis=1)
    dce = dce + gv5 * magnitude
    t = d.t[rows]
    zl = ex["zloss"]
    ce = np.where(ignored, 0.0, ce)
    loss_rows = np.where(ignored, 0.0, t * (ce + zl))
    out["dloss"] = np.where(ignored, 0.0, t * (dce + dzl) + 2.0 * ua * t * (np.abs(ce) + np.abs(zl)))
    out["loss_rows_exact"] = loss_rows
    out["ds"], out["s"], out["argmax"], out["lse_exact"] = ds, s, ex["argmax"], lse
    out["floor_a"] = floor_a
    if not want_grads:
        return out

    # Section 6: dlogits.
    p_underflow, g9 = smallest_normal(ua), gamma(9.0, ua)
    rho_r = gamma(d.n + 1.0, ua) if d.reduction == "mean" else 0.0
    q = d.loss_coef[rows] * t
    g_lse = np.zeros_like(q) if d.grad_lse is None else d.grad_lse[rows]
    g_ent = np.zeros_like(q) if d.grad_entropy is None else d.grad_entropy[rows]
    class_sum = float(d.c.sum())
    # z-loss's 2 l lse only where l > 0: 0 * inf is NaN in a row of +inf logits.
    zl = 2 * l * lse if l != 0 else np.zeros_like(lse)
    dzl = 2.0 * l * dlse if l != 0 else np.zeros_like(dlse)
    A = (1 - e) * cy + e / v * class_sum + zl
    dA = dzl + gv5 * ((1 - e) * cy + e / v * class_sum + np.abs(zl))
    dp = _p_error(logp, p, relp, _p_max(0.0, s, lse, ev, d.k, pr))
    dmu = (pw(p, ds) + pw(dp + p * gv1, np.abs(s))).sum(axis=1)
    # The score and p as the gradient pass has them (u_q): ds + q, relP + q.
    dq = _packed_score_errors(s, pr.u_packed, ua)
    ds, dp = ds + dq, _p_error(logp, p, relp + dq, _p_max(dq, s, lse, ev, d.k, pr))
    onehot = np.zeros_like(p, dtype=bool)
    onehot[at[~ignored], y[~ignored]] = True
    qc, Ac = q[:, None], A[:, None]
    T1 = np.abs(qc * Ac) * p
    T2 = np.where(onehot, np.abs(qc) * (1 - e) * cy[:, None], 0.0)
    T3 = np.abs(qc) * e / v * d.c[None, :]
    T4 = np.abs(g_lse)[:, None] * p
    sm = s - mu[:, None]
    T5 = np.abs(g_ent)[:, None] * pw(p, np.abs(sm))
    dgs = (g9 * (T1 + T2 + T3 + T4 + T5) + mul0(np.abs(qc * Ac), dp) + T1 * rho_r
           + pw(np.abs(qc) * p, dA[:, None]) + (T2 + T3) * rho_r
           + mul0(np.abs(g_lse)[:, None], dp) + mul0(np.abs(g_ent)[:, None] * np.abs(sm), dp)
           + mul0(np.abs(g_ent)[:, None], pw(p + dp, ds + dmu[:, None])))
    ent_term = np.where((g_ent[:, None] != 0) & np.isfinite(sm), np.abs(g_ent[:, None] * sm), 0.0)
    dgs = dgs + p_underflow * (np.abs(qc * Ac) + np.abs(g_lse)[:, None] + ent_term)
    # The exact d objective / d s, then through the softcap and the scale.
    gs = np.where(qc != 0, qc * (p * Ac - e / v * d.c[None, :]), 0.0)
    gs = gs - np.where(onehot, qc * (1 - e) * cy[:, None], 0.0)
    gs = gs + g_lse[:, None] * p - g_ent[:, None] * pw(p, sm)
    if d.k > 0:
        slope = 1.0 - (s / d.k) ** 2
        dL = 2.0 * np.abs(s) * ds / (d.k * d.k) + 6.0 * ua
        dgz = slope * dgs + np.abs(gs) * dL
    else:
        slope, dgz = 1.0, dgs
    G = d.a * slope * gs
    out["G"] = G
    out["dG"] = d.a * dgz + (3.0 if d.k > 0 else 2.0) * ua * np.abs(G)
    return out


def reduction_bound(d, pr, sum_dloss, sum_abs_loss, total, u_out):
    """Section 5, the reduced loss (sum or mean), before nothing else."""
    ua = pr.u_accum
    floor = (d.n + d.v + d.h + 8) * tiny(ua) + tiny(u_out)
    gn = gamma(d.n, ua)
    if d.reduction == "sum":
        return sum_dloss + gn * sum_abs_loss + u_out * abs(total) + floor
    if d.denominator > 0:
        return ((sum_dloss + gn * sum_abs_loss) / d.denominator
                + gamma(d.n + 1.0, ua) * abs(total) + u_out * abs(total) + floor)
    return 0.0


def filter_allowance(d, pr, rows, blk, eps):
    """Section 7's gradient filtering (tolerance.cpp's filter_allowance):
    per entry of the rows `rows`, |G'_ij| where the filter may leave it out
    of the GEMMs, |G'_ij| <= eps (kappa_i + dkappa_i) + dG'_ij, else 0.
    G' = G - u c^T removes label smoothing's uniform term; with a softcap
    and label smoothing together the filter is off (all 0)."""
    G = blk["G"]
    if d.k > 0 and d.e > 0:
        return np.zeros_like(G)
    ua, e, a, v = pr.u_accum, d.e, d.a, d.v
    ignored = d.ignored[rows]
    g = np.where(ignored, 0.0, d.loss_coef[rows] * d.t[rows])
    cy = np.where(ignored, 0.0, d.c[np.where(ignored, 0, d.labels[rows])])
    g_lse = 0.0 if d.grad_lse is None else d.grad_lse[rows]
    g_ent = 0.0 if d.grad_entropy is None else d.grad_entropy[rows]
    coef_p = g * ((1 - e) * cy + e / v * float(d.c.sum()) + 2 * d.l * blk["lse_exact"]) + g_lse
    kappa = a * (np.abs(coef_p) + np.abs(g_ent))
    dkappa = a * np.abs(g) * 2 * d.l * blk["lse"] + 8 * ua * kappa
    u = -a * g * e / v
    gp = np.abs(G - u[:, None] * d.c[None, :])
    threshold = eps * (kappa + dkappa)[:, None] + gemm_input_error(pr, G, blk["dG"])
    return np.where(gp <= threshold, gp, 0.0)


def gradient_parts(d, pr, G, dG):
    """Section 7's G' terms: what multiplies |W| (for grad_x) and |x| (for
    grad_W, grad_b) in the GEMM bounds."""
    ua = pr.u_accum
    dg = gemm_input_error(pr, G, dG)
    for_x = dg + gamma(d.v + 1.0, ua) * np.abs(G)
    for_w = dg + gamma(d.n + 1.0, ua) * np.abs(G)
    return for_x, for_w
