#!/usr/bin/env python3
"""make_quant_golden.py: golden data for tests/test_quant.c (kernels/quant).

An independent implementation of the rules in doc/formats.md, built on ml_dtypes
(float8_e4m3fn, float8_e5m2, float4_e2m1fn, float8_e8m0fnu) and numpy, sharing no code with
the C side. Element casts come from ml_dtypes (saturation is a clip before the cast); fp32
arithmetic is numpy float32 (IEEE, round to nearest even); scale exponents and stochastic
rounding decisions use exact rationals.

Writes three small safetensors files to tests/data/quant/ (or the directory given):
  elements.safetensors  every element type: encodings (both overflow modes) of values on,
                        between and at ties of each grid, past the max, subnormals, -0, NaN,
                        Inf; decodings of every code; stochastic rounding draws
  blocks.safetensors    every quantizer, both directions, both MX scale rules, NVFP4 per
                        tensor / per row / given second level, 1x16 and 16x16 blocks, and
                        stochastic rounding, on three inputs (fin: edge cases, all finite;
                        ext: extreme magnitudes; spec: NaN and Inf), plus dequantized values
  hadamard.safetensors  the transform and its inverse, sizes 16 and 32, both axes, fixed and
                        random signs: random inputs (compare with a tolerance) and integer
                        inputs (exact: bit-for-bit)

Run: python3 tests/tools/make_quant_golden.py [outdir]   (ml_dtypes 0.6, numpy, safetensors)
The tensors are deterministic (fixed seeds); only the JSON header's key order may vary.
"""
import math
import os
import sys
from bisect import bisect_right
from fractions import Fraction

import ml_dtypes as md
import numpy as np
from safetensors.numpy import save_file

F32 = np.float32
DT = {"e4m3": md.float8_e4m3fn, "e5m2": md.float8_e5m2, "e2m1": md.float4_e2m1fn,
      "e8m0": md.float8_e8m0fnu, "ue4m3": md.float8_e4m3fn}
MAX = {"e4m3": 448.0, "e5m2": 57344.0, "e2m1": 6.0, "e8m0": 2.0 ** 127, "ue4m3": 448.0}
EMAX = {"e4m3": 8, "e5m2": 15, "e2m1": 2}        # exponent of the top binade (OCP emax_elem)
NCODES = {"e4m3": 256, "e5m2": 256, "e2m1": 16, "e8m0": 256, "ue4m3": 256}

# --- the counter-based RNG of kernels/common.c (splitmix64 finaliser) -------------------------
M64 = (1 << 64) - 1


def hash64(x):
    x = (x + 0x9E3779B97F4A7C15) & M64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & M64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & M64
    return x ^ (x >> 31)


def rand_u64(seed, stream, counter):
    return hash64(hash64(hash64(seed) ^ stream) ^ counter)


def quant_stream(step, tensor):
    return hash64(step) ^ tensor


# --- element codecs -----------------------------------------------------------------------------

def f32(a):
    return np.ascontiguousarray(a, dtype=F32)      # safetensors writes memory order


def encode(t, x, sat):
    """Round to nearest even (E8M0: as ml_dtypes, ties up); sat: clip to +-max first."""
    x = f32(x)
    nan = np.isnan(x)
    neg = np.signbit(x)
    if t == "e2m1":                                   # ml_dtypes saturates; NaN -> +6 (0x7)
        c = x.astype(DT[t]).view(np.uint8)
        return np.where(nan, np.uint8(0x7), c).astype(np.uint8)
    if t in ("e4m3", "e5m2"):
        y = np.clip(x, -MAX[t], MAX[t]) if sat else x  # the clip keeps NaN
        return y.astype(DT[t]).view(np.uint8)
    if t == "e8m0":
        c = x.astype(DT[t]).view(np.uint8)
        # ml_dtypes 0.6 rounds fp32 subnormals in (2^-127, 1.5 * 2^-127) up to 2^-126, though
        # 2^-127 is nearer; lowbit rounds to the nearest (doc/formats.md).
        c = np.where((x > F32(2.0 ** -127)) & (x < F32(1.5 * 2.0 ** -127)), np.uint8(0), c)
        if sat:
            c = np.where(~nan & ~neg & (x >= F32(1.5 * 2.0 ** 127)), np.uint8(0xFE), c)
        return c.astype(np.uint8)
    if t == "ue4m3":
        y = np.abs(x)
        if sat:
            y = np.clip(y, 0, 448.0)
        c = y.astype(DT[t]).view(np.uint8)
        bad = nan | (neg & (x != 0))                  # negative values are NaN, -0 is 0
        return np.where(bad, np.uint8(0x7F), c).astype(np.uint8)
    raise ValueError(t)


def decode(t, codes):
    codes = np.asarray(codes, dtype=np.uint8)
    if t == "ue4m3":
        v = codes.view(DT[t]).astype(F32)
        return np.where(codes >= 0x80, F32(np.nan), v).astype(F32)
    return codes.view(DT[t]).astype(F32)


def grid(t):
    """Non-negative finite values of t, ascending, as Python floats."""
    v = decode(t, np.arange(NCODES[t], dtype=np.uint8)).astype(np.float64)
    v = v[np.isfinite(v) & (v >= 0) & ~np.signbit(v)]
    return sorted(set(v.tolist()))


GRID = {t: grid(t) for t in DT}


def encode_sr(t, x, r):
    """Stochastic rounding (saturating): between neighbours lo < hi of the grid, round up
    iff r / 2^64 < (|x| - lo) / (hi - lo), in exact rationals."""
    x = F32(x)
    if np.isnan(x) or x == 0 or (t in ("e8m0", "ue4m3") and np.signbit(x)):
        return int(encode(t, [x], 1)[0])
    g = GRID[t]
    a = abs(float(x))
    if a >= g[-1]:
        v = g[-1]
    else:
        i = bisect_right(g, a) - 1
        lo, hi = g[i], g[i + 1]
        p = (Fraction(a) - Fraction(lo)) / (Fraction(hi) - Fraction(lo))
        v = hi if Fraction(r, 1 << 64) < p else lo
    return int(encode(t, [math.copysign(v, float(x))], 1)[0])


# --- block quantizers -----------------------------------------------------------------------------

def mx_exponent(amax, elem, rule):
    a = Fraction(float(amax))
    if rule == "floor":
        k = math.frexp(float(amax))[1] - 1 - EMAX[elem]
    else:                                             # smallest k with amax <= max * 2^k
        mx = Fraction(MAX[elem])
        k = math.ceil(math.log2(float(amax) / MAX[elem]))
        while a > mx * Fraction(2) ** k:
            k += 1
        while a <= mx * Fraction(2) ** (k - 1):
            k -= 1
    return min(max(k, -127), 127)


def nvfp4_scale2(amax):
    if not np.isfinite(amax):
        return F32(np.nan)
    s = F32(F32(amax) / F32(2688.0))
    return F32(1.0) if s == 0 else s


def quantize(x, case, colwise, s2_given=None, sr=None):
    """Returns (codes (R, C) unpacked, scales (SR, SC), scale2 or None, elem) for case."""
    fmt = case["fmt"]
    xs = np.ascontiguousarray(f32(x).T if colwise else f32(x))
    R, C = xs.shape
    w = case.get("weight", 0)
    if fmt == "fp8":
        elem, br, bc = "e4m3", 128 if w else 1, 128
    elif fmt == "mxfp8":
        elem, br, bc = case.get("elem", "e4m3"), 1, 32
    elif fmt == "mxfp4":
        elem, br, bc = "e2m1", 1, 32
    else:
        elem, br, bc = "e2m1", 16 if w else 1, 16
    SR, SC = -(-R // br), -(-C // bc)
    codes = np.zeros((R, C), np.uint8)
    scales = np.zeros((SR, SC), F32 if fmt == "fp8" else np.uint8)
    s2 = None
    if fmt == "nvfp4":
        mode = case["s2"]
        if mode == "tensor":
            s2 = f32([nvfp4_scale2(np.max(np.abs(xs)))])
        elif mode == "row":
            s2 = f32([nvfp4_scale2(np.max(np.abs(xs[r]))) for r in range(R)])
        else:
            s2 = f32([s2_given])
    for bi in range(SR):
        for bj in range(SC):
            r0, r1, c0, c1 = bi * br, min(R, bi * br + br), bj * bc, min(C, bj * bc + bc)
            blk = xs[r0:r1, c0:c1]
            finite = bool(np.all(np.isfinite(blk)))
            amax = F32(np.max(np.abs(blk))) if finite else F32(np.nan)
            if fmt == "fp8":
                s = F32(amax / F32(448.0)) if finite else F32(np.nan)
                if s == 0:
                    s = F32(1.0)
                scales[bi, bj] = s
                d = s
            elif fmt == "nvfp4":
                s2r = s2[r0 if case["s2"] == "row" else 0]
                v = F32(F32(amax / F32(6.0)) / s2r) if finite else F32(np.nan)
                sc = encode("ue4m3", [v], 1)[0]
                scales[bi, bj] = sc
                d = F32(decode("ue4m3", [sc])[0] * s2r)
            else:
                if not finite:
                    sc = 0xFF
                elif amax == 0:
                    sc = 127
                else:
                    k = mx_exponent(amax, elem, case.get("rule", "ceil"))
                    sc = int(f32([2.0 ** k]).astype(DT["e8m0"]).view(np.uint8)[0])
                scales[bi, bj] = sc
                d = decode("e8m0", [sc])[0]
            if np.isnan(d) or d == 0:
                continue                              # codes stay 0
            y = (blk / d).astype(F32)
            if sr is None:
                codes[r0:r1, c0:c1] = encode(elem, y, 1)
            else:
                seed, stream = sr
                for r in range(r0, r1):
                    for c in range(c0, c1):
                        rnd = rand_u64(seed, stream, r * C + c)
                        codes[r, c] = encode_sr(elem, y[r - r0, c - c0], rnd)
    return codes, scales, s2, elem, br, bc


def pack(codes, elem):
    if elem != "e2m1":
        return codes
    R, C = codes.shape
    p = np.zeros((R, (C + 1) // 2), np.uint8)
    p |= codes[:, 0::2]                               # element 2i: low nibble
    p[:, : C // 2] |= (codes[:, 1::2] << 4).astype(np.uint8)
    return p


def dequantize(codes, scales, s2, elem, fmt, br, bc):
    R, C = codes.shape
    e = decode(elem, codes)
    si = np.arange(R)[:, None] // br, np.arange(C)[None, :] // bc
    if fmt == "fp8":
        return (e * scales[si]).astype(F32)
    if fmt == "nvfp4":
        s = decode("ue4m3", scales)[si]
        s2r = s2[:, None] if len(s2) == R and len(s2) > 1 else s2[0]
        return ((e * s).astype(F32) * s2r).astype(F32)
    with np.errstate(over="ignore"):                  # a block at FLT_MAX may round to 2^128
        return (e * decode("e8m0", scales)[si]).astype(F32)


# --- inputs ---------------------------------------------------------------------------------------

def e4m3_midpoints():
    g = GRID["e4m3"]
    return [(a + b) / 2 for a, b in zip(g, g[1:])]


def make_fin(rng):
    """(37, 135): cols 135 = 128 + 7 and rows 37 leave partial blocks of every size; rows of
    different kinds, so column-wise blocks mix wildly different magnitudes."""
    R, C = 37, 135
    J = 3                                              # tensor amax 2688 * 2^J: s2 = 2^J exactly
    x = np.zeros((R, C), np.float64)
    e2 = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]
    mids = e4m3_midpoints()
    ue = GRID["ue4m3"][1:]
    uemid = [(a + b) / 2 for a, b in zip(GRID["ue4m3"], GRID["ue4m3"][1:])]
    sgn = lambda n: rng.choice([-1.0, 1.0], n)
    for r in range(R):
        kind = r % 12
        row = np.zeros(C)
        for s0 in range(0, C, 16):
            n = min(16, C - s0)
            if kind == 0:                              # few significant bits: ties everywhere
                row[s0:s0 + n] = rng.integers(-64, 65, n) * 2.0 ** rng.integers(-24, 8)
            elif kind == 1:                            # random, magnitude per 16 from 1e-6 to 1e3
                row[s0:s0 + n] = rng.standard_normal(n) * 10.0 ** rng.uniform(-6, 3)
            elif kind == 2:                            # zero blocks, +-0, then random
                row[s0:s0 + n] = 0.0 if s0 < 32 or s0 >= 128 else rng.standard_normal(n)
            elif kind == 3:                            # E4M3 ties under a power-of-two scale
                j = int(rng.integers(-4, 4))
                row[s0:s0 + n] = sgn(n) * rng.choice(mids, n) * 2.0 ** j
            elif kind == 4:                            # E2M1 ties, 32-block amax 6 * 2^j
                j = int(rng.integers(-6, 6))
                row[s0:s0 + n] = sgn(n) * rng.choice(e2, n) * 2.0 ** j
                if s0 % 32 == 0:
                    row[s0] = 6.0 * 2.0 ** j
            elif kind == 5:                            # one outlier, the rest tiny
                row[s0:s0 + n] = rng.standard_normal(n) * 1e-3
                row[s0 + int(rng.integers(0, n))] = sgn(1)[0] * rng.uniform(1e3, 1e4)
            elif kind == 6:                            # around the MX rules' boundaries
                j = int(rng.integers(-8, 4))
                base = rng.choice([448.0, 464.0, 480.0, 448.0 * (1 + 2.0 ** -10), 447.0,
                                   6.0, 7.0, 6.5, 5.9, 57344.0 / 256, 1.99, 1.76, 1.5], n)
                row[s0:s0 + n] = sgn(n) * base * 2.0 ** j * rng.choice([1.0, 0.25, 1 / 64.0], n)
            elif kind in (7, 8):                       # NVFP4: exact block scales (ties in E2M1
                v = float(rng.choice(ue if kind == 7 else uemid))   # or in UE4M3 for kind 8)
                d = v * 2.0 ** J
                row[s0:s0 + n] = sgn(n) * rng.choice(e2, n) * d
                row[s0] = 6.0 * d                      # block amax / 6 / s2 = v
            elif kind == 9:                            # blocks too small for the UE4M3 scale
                row[s0:s0 + n] = rng.standard_normal(n) * (1e-6 if s0 else 1e2) * 2.0 ** J
            elif kind == 10:                           # subnormals of E4M3/E2M1 after scaling
                row[s0:s0 + n] = sgn(n) * rng.choice([2.0 ** -9, 3 * 2.0 ** -11, 2.0 ** -10,
                                                      2.0 ** -11, 5 * 2.0 ** -10, 0.25, 0.75,
                                                      2.0 ** -7], n)
                row[s0] = 448.0
            else:
                row[s0:s0 + n] = rng.standard_normal(n)
        if kind in (7, 8):
            row[0] = 2688.0 * 2.0 ** J                 # row amax: per-row s2 = 2^J as well
        x[r] = row
    x[2, 5] = x[2, 40] = x[14, 1] = -0.0
    x[26, 130] = -0.0
    x[9, 77] = 2688.0 * 2.0 ** J                       # the tensor amax
    assert np.max(np.abs(x)) == 2688.0 * 2.0 ** J
    return f32(x)


def make_ext(rng):
    """(4, 48): extreme magnitudes: fp32 max, fp32 subnormals, 1e+-30 in one block, 2^-127."""
    x = np.zeros((4, 48), np.float64)
    x[0] = rng.standard_normal(48) * 1e30
    x[0, 3] = 3.4028234663852886e38                    # fp32 max
    x[0, 20] = -3e38
    x[1] = rng.standard_normal(48) * 1e-40             # fp32 subnormals
    x[1, 10] = 1.4e-45
    x[2, 0:16] = rng.standard_normal(16) * 1e30
    x[2, 16:32] = rng.standard_normal(16) * 1e-30
    x[2, 32:48] = np.where(np.arange(16) % 2, 1e30, 1e-30)
    x[3] = rng.standard_normal(48) * 2.0 ** -127       # MX exponent clamped at -127
    x[3, 40:48] = 1e-38
    return f32(x)


def make_spec(rng):
    """(5, 40): NaN, +Inf, -Inf inside otherwise normal rows; a finite row; a zero row."""
    x = f32(rng.standard_normal((5, 40)))
    x[0, 3] = np.nan
    x[1, 20] = np.inf
    x[2, 35] = -np.inf
    x[3, 7] = -0.0
    x[4] = 0.0
    x[4, 1::3] = -0.0
    return x


CASES = {
    "fp8": {"fmt": "fp8"},
    "fp8w": {"fmt": "fp8", "weight": 1},
    "mxfp8": {"fmt": "mxfp8", "rule": "ceil"},
    "mxfp8f": {"fmt": "mxfp8", "rule": "floor"},
    "mxfp8e5": {"fmt": "mxfp8", "elem": "e5m2", "rule": "ceil"},
    "mxfp8e5f": {"fmt": "mxfp8", "elem": "e5m2", "rule": "floor"},
    "mxfp4": {"fmt": "mxfp4", "rule": "ceil"},
    "mxfp4f": {"fmt": "mxfp4", "rule": "floor"},
    "nvfp4": {"fmt": "nvfp4", "s2": "tensor"},
    "nvfp4r": {"fmt": "nvfp4", "s2": "row"},
    "nvfp4g": {"fmt": "nvfp4", "s2": "given"},
    "nvfp4w": {"fmt": "nvfp4", "s2": "tensor", "weight": 1},
    "nvfp4wg": {"fmt": "nvfp4", "s2": "given", "weight": 1},
    "fp8_sr": {"fmt": "fp8", "sr": 1},
    "mxfp4_sr": {"fmt": "mxfp4", "rule": "ceil", "sr": 1},
    "nvfp4_sr": {"fmt": "nvfp4", "s2": "tensor", "sr": 1},
}
SR_SEED, SR_STEP, SR_TENSOR = 1234, 7, 42


def make_blocks(rng):
    out = {}
    inputs = {"fin": make_fin(rng), "ext": make_ext(rng), "spec": make_spec(rng)}
    stream = quant_stream(SR_STEP, SR_TENSOR)
    for iname, x in inputs.items():
        out[f"{iname}.x"] = x
        fin = np.all(np.isfinite(x))
        # Half the tensor's own scale: blocks saturate the UE4M3 scale and then E2M1.
        s2g = F32(nvfp4_scale2(np.max(np.abs(x))) * F32(0.5)) if fin else F32(0.001)
        out[f"{iname}.s2_given"] = f32([s2g])
        for cname, case in CASES.items():
            for d in ("row", "col"):
                sr = (SR_SEED, stream) if case.get("sr") else None
                codes, sc, s2, elem, br, bc = quantize(x, case, d == "col", s2g, sr)
                key = f"{iname}.{cname}.{d}"
                out[key + ".data"] = pack(codes, elem)
                out[key + ".scale"] = sc
                if s2 is not None:
                    out[key + ".scale2"] = s2
                want_deq = (iname != "fin" and d == "row" and not case.get("sr")) or \
                           (iname == "fin" and d == "row" and cname == "nvfp4")
                if want_deq:
                    out[key + ".deq"] = dequantize(codes, sc, s2, elem, case["fmt"], br, bc)
    return out


def make_elements(rng):
    out = {}
    common = [0.0, -0.0, np.nan, -np.nan, np.inf, -np.inf, 1e-45, -1e-45, 1e-40, 1.17e-38,
              3.4028234663852886e38, -3.4028234663852886e38, 1.0, -1.0, 0.1, 1e-3, 1e3, 1e6,
              1e-10, -1e-10]
    for t in DT:
        g = np.array(GRID[t])
        if t == "e8m0":
            g = g[g > 0]
        mids = (g[1:] + g[:-1]) / 2
        vals = list(g) + list(mids) + common
        vals += [MAX[t] * 1.0000001, MAX[t] * 1.03, MAX[t] * 1.0625, MAX[t] * 1.07,
                 MAX[t] * 1.125, MAX[t] * 1.2, MAX[t] * 2, MAX[t] * 1e3]
        v32 = f32([v for v in vals if not (np.isfinite(v) and abs(v) > 3.4028234663852886e38)])
        # One fp32 ulp either side of every midpoint: the tie must be what decides.
        m32 = f32(mids[np.abs(mids) < 3e38])
        near = np.concatenate([np.nextafter(m32, F32(np.inf)), np.nextafter(m32, F32(0))])
        rnd = f32(rng.standard_normal(64) * 10.0 ** rng.uniform(-3, 2, 64) * MAX[t] ** 0.5)
        x = np.concatenate([v32, near, rnd]).astype(F32)
        x = np.concatenate([x, -x]) if t not in ("e8m0", "ue4m3") else np.concatenate([x, -x[:8]])
        out[f"{t}.x"] = x
        out[f"{t}.sat"] = encode(t, x, 1)
        out[f"{t}.nosat"] = encode(t, x, 0)
        out[f"{t}.decode"] = decode(t, np.arange(NCODES[t], dtype=np.uint8))
    # Stochastic rounding: a few values (between neighbours, subnormal, tiny, on the grid,
    # past the max), each drawn at 32 counters.
    stream = quant_stream(SR_STEP, SR_TENSOR)
    for t in ("e4m3", "e5m2", "e2m1"):
        g = GRID[t]
        base = [g[5] * 0.3 + g[6] * 0.7, g[1] * 0.5, g[1] * 0.01, g[-2] * 0.9 + g[-1] * 0.1,
                g[len(g) // 2], MAX[t] * 1.5, 0.0, -0.0, np.nan, -(g[2] * 0.75 + g[3] * 0.25),
                1e-30, 0.3, -2.7]
        x = np.repeat(f32(base), 32)
        out[f"sr.{t}.x"] = x
        out[f"sr.{t}.codes"] = np.array(
            [encode_sr(t, x[i], rand_u64(SR_SEED, stream, i)) for i in range(len(x))], np.uint8)
    return out


def sylvester(n):
    h = np.array([[1.0]])
    while h.shape[0] < n:
        h = np.block([[h, h], [h, -h]])
    return h


def hadamard_ref(x, axis, n, signs, inverse, normalise=True):
    """Float64 reference of the forward / inverse transform along axis (normalise=False:
    without the 1/sqrt(n), exact for integer inputs)."""
    h = sylvester(n) / math.sqrt(n) if normalise else sylvester(n)
    s = np.array([-1.0 if (signs >> j) & 1 else 1.0 for j in range(n)])
    y = np.moveaxis(np.asarray(x, np.float64), axis, -1).copy()
    shp = y.shape
    y = y.reshape(-1, n)
    y = (s * (y @ h.T)) if inverse else ((y * s) @ h.T)
    return np.ascontiguousarray(np.moveaxis(y.reshape(shp), -1, axis))


def make_hadamard(rng):
    out = {}
    xr = f32(rng.standard_normal((32, 32)) * np.exp(rng.standard_normal((32, 1))))
    xi = f32(rng.integers(-1000, 1001, (32, 32)))
    out["x"], out["xi"] = xr, xi
    seed, step, site = 99, 5, 3
    # Each (size, axis, signs) combination is checked once against the float64 reference
    # (with a tolerance) and once exactly on integers, on complementary halves to stay small.
    for n in (16, 32):
        sg = rand_u64(seed, quant_stream(step, site), 0) & ((1 << n) - 1)
        out[f"signs{n}"] = np.array([sg], np.uint64).view(np.uint8)
        for axis, an in ((0, "rows"), (1, "cols")):
            for sname, signs in (("det", 0), ("rand", sg)):
                key = f"h{n}.{an}.{sname}"
                if sname == "rand":
                    out[key + ".inv"] = f32(hadamard_ref(xr, axis, n, signs, True))
                if ((n == 16) ^ (an == "rows") ^ (sname == "rand")):
                    out[key + ".fwd"] = f32(hadamard_ref(xr, axis, n, signs, False))
                else:
                    # Integers: the sums are exact in fp32; then one multiply by fp32(1/sqrt n).
                    ints = hadamard_ref(xi, axis, n, signs, False, normalise=False)
                    assert np.max(np.abs(ints)) < 2 ** 24
                    out[key + ".fwd_exact"] = (f32(ints) * F32(1.0 / math.sqrt(n))).astype(F32)
    return out, (seed, step, site)


def main():
    outdir = sys.argv[1] if len(sys.argv) > 1 else os.path.join(
        os.path.dirname(os.path.abspath(__file__)), "..", "data", "quant")
    os.makedirs(outdir, exist_ok=True)
    rng = np.random.default_rng(20250603)
    meta = {"generator": "tests/tools/make_quant_golden.py", "ml_dtypes": md.__version__,
            "numpy": np.__version__, "sr_seed": str(SR_SEED), "sr_step": str(SR_STEP),
            "sr_tensor": str(SR_TENSOR)}
    save_file(make_elements(rng), os.path.join(outdir, "elements.safetensors"), metadata=meta)
    save_file(make_blocks(rng), os.path.join(outdir, "blocks.safetensors"), metadata=meta)
    h, (seed, step, site) = make_hadamard(rng)
    hm = dict(meta, h_seed=str(seed), h_step=str(step), h_site=str(site))
    save_file(h, os.path.join(outdir, "hadamard.safetensors"), metadata=hm)
    for f in ("elements", "blocks", "hadamard"):
        p = os.path.join(outdir, f + ".safetensors")
        print(f"{p}: {os.path.getsize(p)} bytes")


if __name__ == "__main__":
    main()
