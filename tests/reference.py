"""An independent NumPy float64 reference for the transformer block.

Written from the chapter's PyTorch semantics (d2l `MultiHeadAttention`, the
chapter's `FeedForward` and `TransformerBlock`), not from blocklab: plain
float64 NumPy with explicit loops over heads and queries. Weights come as a
flat dict of arrays named like a PyTorch `state_dict` (`attention.W_q.weight`,
`ffn.W_g.weight`, `norm1.weight`, ...), weights in the `(out, in)` layout.

This module is a helper imported by the tests, not a test file.
"""

from __future__ import annotations

import math

import numpy as np

MASK_VALUE = -1e6  # d2l's masked_softmax fills masked scores with -1e6
GATED = {
    "swiglu": "silu", "geglu": "gelu", "reglu": "relu", "bilinear": "identity",
    "geglu_exact": "gelu_exact",
}  # fmt: skip
UNGATED = ("relu", "gelu", "gelu_exact")
ALL_ACTS = UNGATED + tuple(GATED)
ALL_PLACEMENTS = ("post", "pre", "output", "sandwich")

_erf = np.vectorize(math.erf, otypes=[np.float64])


# ---------------------------------------------------------------- elementwise
def relu(z):
    return np.maximum(np.asarray(z, np.float64), 0.0)


def gelu(z):
    """GELU, tanh approximation (PyTorch `approximate='tanh'`)."""
    z = np.asarray(z, np.float64)
    return 0.5 * z * (1.0 + np.tanh(math.sqrt(2.0 / math.pi) * (z + 0.044715 * z**3)))


def gelu_exact(z):
    z = np.asarray(z, np.float64)
    return 0.5 * z * (1.0 + _erf(z / math.sqrt(2.0)))


def silu(z):
    z = np.asarray(z, np.float64)
    return z / (1.0 + np.exp(-z))


def identity(z):
    return np.asarray(z, np.float64)


ELEMENTWISE = {
    "relu": relu,
    "gelu": gelu,
    "gelu_exact": gelu_exact,
    "silu": silu,
    "identity": identity,
}


# ---------------------------------------------------------------------- norms
def rms_norm(x, weight=None, eps=1e-6):
    x = np.asarray(x, np.float64)
    out = np.empty_like(x)
    flat, res = x.reshape(-1, x.shape[-1]), out.reshape(-1, x.shape[-1])
    for r in range(flat.shape[0]):
        ms = sum(v * v for v in flat[r]) / flat.shape[1]
        res[r] = flat[r] / math.sqrt(ms + eps)
    return out if weight is None else out * np.asarray(weight, np.float64)


def layer_norm(x, weight=None, bias=None, eps=1e-6):
    x = np.asarray(x, np.float64)
    mu = x.mean(-1, keepdims=True)
    var = ((x - mu) ** 2).mean(-1, keepdims=True)  # biased, as torch
    y = (x - mu) / np.sqrt(var + eps)
    if weight is not None:
        y = y * np.asarray(weight, np.float64)
    if bias is not None:
        y = y + np.asarray(bias, np.float64)
    return y


# -------------------------------------------------------------------- softmax
def lengths(valid_lens, num_queries):
    """Per-query lengths from None / scalar / (Tq,), or None."""
    if valid_lens is None:
        return None
    lens = np.asarray(valid_lens)
    if lens.ndim == 0:
        return np.full(num_queries, int(lens))
    return lens.astype(int)


def masked_softmax(scores, valid_lens=None):
    """d2l's masked softmax on `(..., Tq, Tk)`: masked scores become -1e6."""
    s = np.array(scores, np.float64)
    lens = lengths(valid_lens, s.shape[-2])
    out = np.empty_like(s)
    rows_s = s.reshape(-1, s.shape[-2], s.shape[-1])
    rows_o = out.reshape(rows_s.shape)
    for b in range(rows_s.shape[0]):
        for i in range(rows_s.shape[1]):
            row = rows_s[b, i].copy()
            if lens is not None:
                row[lens[i] :] = MASK_VALUE
            e = np.exp(row - row.max())
            rows_o[b, i] = e / e.sum()
    return out


def entropy(p):
    p = np.asarray(p, np.float64)
    with np.errstate(divide="ignore", invalid="ignore"):
        return -np.where(p > 0, p * np.log(np.where(p > 0, p, 1.0)), 0.0).sum(-1)


# ------------------------------------------------------------------ sublayers
def linear(sd, name, x):
    y = np.asarray(x, np.float64) @ np.asarray(sd[f"{name}.weight"], np.float64).T
    if f"{name}.bias" in sd:
        y = y + np.asarray(sd[f"{name}.bias"], np.float64)
    return y


def norm(sd, name, x, kind, eps=1e-6):
    if kind == "rms":
        return rms_norm(x, sd[f"{name}.weight"], eps)
    return layer_norm(x, sd[f"{name}.weight"], sd[f"{name}.bias"], eps)


def attention(sd, x, num_heads, valid_lens=None, prefix="attention", qk_eps=1e-6):
    """d2l multi-head attention on one sequence; returns (out, weights, logits).

    Head i owns features `i*p:(i+1)*p` of each projection (d2l's
    `transpose_qkv` reshapes to (T, h, p)). With `{prefix}.q_norm.weight` in
    `sd`, queries and keys are RMS-normalized over p with those gains.
    """
    x = np.asarray(x, np.float64)
    T, d = x.shape
    p = d // num_heads
    q = linear(sd, f"{prefix}.W_q", x)
    k = linear(sd, f"{prefix}.W_k", x)
    v = linear(sd, f"{prefix}.W_v", x)
    logits = np.empty((num_heads, T, T))
    mixed = np.empty((T, d))
    for h in range(num_heads):
        cols = slice(h * p, (h + 1) * p)
        qh, kh, vh = q[:, cols], k[:, cols], v[:, cols]
        if f"{prefix}.q_norm.weight" in sd:
            qh = rms_norm(qh, sd[f"{prefix}.q_norm.weight"], qk_eps)
            kh = rms_norm(kh, sd[f"{prefix}.k_norm.weight"], qk_eps)
        for i in range(T):
            for j in range(T):
                logits[h, i, j] = float(np.dot(qh[i], kh[j])) / math.sqrt(p)
        mixed[:, cols] = masked_softmax(logits[h], valid_lens) @ vh
    weights = masked_softmax(logits, valid_lens)
    return linear(sd, f"{prefix}.W_o", mixed), weights, logits


def ffn(sd, x, act, prefix="ffn"):
    if act in GATED:
        gate = ELEMENTWISE[GATED[act]](linear(sd, f"{prefix}.W_g", x))
        hidden = gate * linear(sd, f"{prefix}.W_1", x)
    else:
        hidden = ELEMENTWISE[act](linear(sd, f"{prefix}.W_1", x))
    return linear(sd, f"{prefix}.W_2", hidden)


def block(sd, x, num_heads, *, norm_kind, act, placement, valid_lens=None, eps=1e-6):
    """The block's forward pass, sublayer by sublayer, for every placement.

    post: x <- N(x + F(x)); pre: x <- x + F(N(x)); output (OLMo 2):
    x <- x + N(F(x)); sandwich (Gemma 3): x <- x + N'(F(N(x))).
    """
    x = np.asarray(x, np.float64)

    def attend(y):
        return attention(sd, y, num_heads, valid_lens)[0]

    def feed(y):
        return ffn(sd, y, act)

    for i, branch in ((1, attend), (2, feed)):
        n = f"norm{i}"
        if placement == "post":
            x = norm(sd, n, x + branch(x), norm_kind, eps)
        elif placement == "pre":
            x = x + branch(norm(sd, n, x, norm_kind, eps))
        elif placement == "output":
            x = x + norm(sd, n, branch(x), norm_kind, eps)
        elif placement == "sandwich":
            inner = branch(norm(sd, n, x, norm_kind, eps))
            x = x + norm(sd, f"out_{n}", inner, norm_kind, eps)
        else:
            raise ValueError(placement)
    return x


# -------------------------------------------------------- random state dicts
def ffn_hidden(d, act):
    """Chapter widths: 4d for ungated, round(8d/3) for gated activations."""
    return round(8 * d / 3) if act in GATED else 4 * d


def random_state_dict(
    rng,
    d,
    *,
    norm_kind="rms",
    act="swiglu",
    placement="pre",
    bias=False,
    dtype=np.float32,
):
    """A PyTorch-style state dict for the chapter's block, with random values.

    Gains and biases are random too (not ones and zeros), so a reference that
    ignored them would disagree.
    """
    sd = {}

    def lin(name, n_in, n_out):
        sd[f"{name}.weight"] = rng.normal(0, 1 / math.sqrt(n_in), (n_out, n_in))
        if bias:
            sd[f"{name}.bias"] = rng.normal(0, 0.1, n_out)

    def nrm(name, width):
        sd[f"{name}.weight"] = 1 + rng.normal(0, 0.2, width)
        if norm_kind == "layer":
            sd[f"{name}.bias"] = rng.normal(0, 0.2, width)

    nrm("norm1", d)
    nrm("norm2", d)
    if placement == "sandwich":
        nrm("out_norm1", d)
        nrm("out_norm2", d)
    for w in ("W_q", "W_k", "W_v", "W_o"):
        lin(f"attention.{w}", d, d)
    width = ffn_hidden(d, act)
    lin("ffn.W_1", d, width)
    lin("ffn.W_2", width, d)
    if act in GATED:
        lin("ffn.W_g", d, width)
    return {k: np.asarray(v, dtype) for k, v in sd.items()}


def add_qk_norm(sd, rng, head_dim, prefix="attention", dtype=np.float32):
    """Add random QK-norm gains (`q_norm.weight`, `k_norm.weight`) to `sd`."""
    for n in ("q_norm", "k_norm"):
        sd[f"{prefix}.{n}.weight"] = np.asarray(1 + rng.normal(0, 0.3, head_dim), dtype)
    return sd


# ------------------------------------------- attention with the model options
def rope(x, positions, theta):
    """Half-split RoPE on (T, p) rows; float32 frequencies, angles and cos/sin
    (the `transformers` convention), the rotation itself in float64."""
    x = np.asarray(x, np.float64)
    T, p = x.shape
    out = np.empty_like(x)
    for t in range(T):
        for i in range(p // 2):
            inv = np.float32(1.0) / np.float32(theta) ** (
                np.float32(2 * i) / np.float32(p)
            )
            angle = np.float32(positions[t]) * inv
            c, s = float(np.cos(angle)), float(np.sin(angle))
            a, b = x[t, i], x[t, i + p // 2]
            out[t, i], out[t, i + p // 2] = a * c - b * s, b * c + a * s
    return out


def attention_general(
    sd,
    x,
    num_heads,
    *,
    num_kv_heads=None,
    head_dim=None,
    scale=None,
    rope_theta=None,
    positions=None,
    window=None,
    valid_lens=None,
    qk_norm=None,
    qk_eps=1e-6,
    unit_offset=False,
):
    """One sequence through attention with every option, by explicit loops.

    Query head i reads key/value head i // (H / KV); `qk_norm` is None,
    "head" (one gain over p shared by the heads) or "full" (over H*p / KV*p
    before the split); RoPE after the norm; key j visible from query i iff
    j < L_i and, with a window w >= 1, i - w < j <= i. Returns
    (out, weights, logits) with weights and logits of shape (H, T, T).
    """
    x = np.asarray(x, np.float64)
    T, d = x.shape
    H = num_heads
    KV = H if num_kv_heads is None else num_kv_heads
    p = d // H if head_dim is None else head_dim
    scale = 1 / math.sqrt(p) if scale is None else scale
    positions = np.arange(T) if positions is None else np.asarray(positions)

    def gain(name):
        w = np.asarray(sd[name], np.float64)
        return 1.0 + w if unit_offset else w

    q = linear(sd, "W_q", x)
    k = linear(sd, "W_k", x)
    v = linear(sd, "W_v", x)
    if qk_norm == "full":
        q = rms_norm(q, gain("q_norm.weight"), qk_eps)
        k = rms_norm(k, gain("k_norm.weight"), qk_eps)
    lens = lengths(valid_lens, T)
    logits = np.zeros((H, T, T))
    weights = np.zeros((H, T, T))
    mixed = np.zeros((T, H * p))
    for h in range(H):
        g = h // (H // KV)
        qh, kh, vh = (
            q[:, h * p : (h + 1) * p],
            k[:, g * p : (g + 1) * p],
            v[:, g * p : (g + 1) * p],
        )
        if qk_norm == "head":
            qh = rms_norm(qh, gain("q_norm.weight"), qk_eps)
            kh = rms_norm(kh, gain("k_norm.weight"), qk_eps)
        if rope_theta is not None:
            qh, kh = rope(qh, positions, rope_theta), rope(kh, positions, rope_theta)
        for i in range(T):
            row = np.array([scale * float(np.dot(qh[i], kh[j])) for j in range(T)])
            logits[h, i] = row
            visible = np.ones(T, bool)
            if lens is not None:
                visible &= np.arange(T) < lens[i]
            if window:
                visible &= (np.arange(T) <= i) & (np.arange(T) > i - window)
            masked = np.where(visible, row, MASK_VALUE)
            e = np.exp(masked - masked.max())
            weights[h, i] = e / e.sum()
            mixed[i, h * p : (h + 1) * p] = weights[h, i] @ vh
    return linear(sd, "W_o", mixed), weights, logits
