"""The kernels' narrower builds on a machine that can run them. CI runs on whatever machine a
session has (AVX-512 one day, AVX2 only the next), and the native build tests only the path of
that machine: these tests also build for the narrower instruction sets this CPU runs
(KVFENCE_KERNELS_ISA, kernels/build.py) and hold them to the same tests, and, where both the
AVX-512 and the AVX2 builds run here, to each other's bits (kernels/simd_vec.h, qgemm.cpp)."""
from __future__ import annotations

import os
import platform
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from kvfence.kernels import CpuKernels, cpu_kernels

ROOT = Path(__file__).resolve().parents[2]
NATIVE = cpu_kernels()
pytestmark = pytest.mark.skipif(NATIVE is None or platform.machine() != "x86_64",
                                reason="the ISA levels are x86-64's, and need the native build")


def _cpu_flags() -> set[str]:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


FLAGS = _cpu_flags() if platform.machine() == "x86_64" else set()
HAS_AVX512_BUILD = NATIVE is not None and NATIVE.gemm_isa == "avx512-bf16"
# narrower builds this CPU can run, and the bf16 matmul each must report
NARROWER = ([("avx2", "avx2")] if HAS_AVX512_BUILD else []) + [("baseline", "none")]


@pytest.mark.parametrize("isa,matmul", NARROWER)
def test_a_narrower_build_passes_the_kernel_tests(isa, matmul):
    """The whole kernel test modules, run against the narrower build in a fresh process."""
    assert CpuKernels(_load(isa)).gemm_isa == matmul   # the build is the path it claims to be
    env = dict(os.environ, KVFENCE_KERNELS_ISA=isa)
    env.pop("PYTEST_ADDOPTS", None)
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           "tests/unit/test_kernels.py", "tests/unit/test_qgemm.py", "tests/unit/test_lm_head.py"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert " passed" in proc.stdout.splitlines()[-1]


def _load(isa: str):
    from kvfence.kernels.build import load_library
    return load_library(isa)


needs_both = pytest.mark.skipif(not HAS_AVX512_BUILD or not {"avx2", "fma"} <= FLAGS,
                                reason="needs a CPU that runs both the AVX-512 and the AVX2 build")


@pytest.fixture(scope="module")
def avx2() -> CpuKernels:
    return CpuKernels(_load("avx2"))


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16) if t.dtype == torch.bfloat16 else t.view(torch.int32)


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> None:
    assert a.dtype == b.dtype and a.shape == b.shape
    differ = (_bits(a) != _bits(b)).nonzero()
    assert differ.numel() == 0, f"{len(differ)} elements differ, first at {differ[0].tolist()}"


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


@needs_both
def test_element_wise_kernels_give_the_same_bits_on_avx2_and_avx512(avx2):
    """simd_vec.h's promise: sixteen lanes on both builds, the same steps per lane and the same
    reduction tree, so add + RMSNorm (bf16 and float32 residual), RoPE and SiLU * up agree bit
    for bit. Rows long enough to take the vector paths, with NaN and infinities in SiLU's input."""
    g = _gen(0)
    n, dim, inter = 64, 576, 1536 + 7          # 7: a scalar tail after the vector lanes
    # rows enough for the norms that a sum of squares added in another order, off by an ulp,
    # moves some bf16 output across a rounding boundary (a mutant summing lanes in order does)
    rows = 8192
    h = torch.randn(rows, dim, generator=g).to(torch.bfloat16)
    delta = torch.randn(rows, dim, generator=g).to(torch.bfloat16)
    w = (1 + 0.1 * torch.randn(dim, generator=g)).to(torch.bfloat16)
    outs = []
    for k in (NATIVE, avx2):
        hh = h.clone()
        outs.append((k.add_rms_norm(hh, delta, w, 1e-5), hh))
    for x, y in zip(outs[0], outs[1]):
        _same_bits(x, y)

    h32 = torch.randn(rows, dim, generator=g) * 3
    outs = []
    for k in (NATIVE, avx2):
        hh = h32.clone()
        outs.append((k.add_rms_norm_f32res(hh, delta, w, 1e-5), hh))
    for x, y in zip(outs[0], outs[1]):
        _same_bits(x, y)

    gu = (torch.randn(n, 2 * inter, generator=g) * 6).to(torch.bfloat16)
    gu[0, 0], gu[1, 17], gu[2, inter + 5], gu[3, 40] = float("nan"), float("inf"), float("nan"), -float("inf")
    gu[4, :inter] = torch.linspace(-95, 95, inter)
    _same_bits(NATIVE.silu_mul(gu), avx2.silu_mul(gu))

    heads, kv_heads, hd, page = 9, 3, 64, 16
    qkv = torch.randn(n, (heads + 2 * kv_heads) * hd, generator=g).to(torch.bfloat16)
    table = torch.randn(32, hd, generator=g)
    cos, sin = table.cos().to(torch.bfloat16), table.sin().to(torch.bfloat16)
    positions = torch.randint(0, 32, (n,), generator=g)
    slots = torch.randperm(n * 2, generator=g)[:n]
    outs = []
    for k in (NATIVE, avx2):
        q = qkv.clone()
        kc = torch.zeros(kv_heads, n * 2, hd, dtype=torch.bfloat16)
        vc = torch.zeros_like(kc)
        k.rope_store(q, heads, kv_heads, hd, positions, cos, sin, kc, vc, slots, page)
        outs.append((q, kc, vc))
    for x, y in zip(outs[0], outs[1]):
        _same_bits(x, y)


@needs_both
@pytest.mark.parametrize("ggml_type", [3, 8])        # Q4_1 (the bundled file's), Q8_0
@pytest.mark.parametrize("m", [1, 5, 32])
def test_native_matmul_gives_the_same_bits_on_avx2_and_avx512_vnni(avx2, ggml_type, m):
    """qgemm.cpp's claim: the AVX2 path forms the same exact integer block sums as vpdpbusd and
    the same fp32 steps after them, so float32, bf16 and gated outputs agree bit for bit."""
    gguf = pytest.importorskip("gguf")
    from kvfence.model.quant import QuantWeight
    assert NATIVE.qgemm_isa == "avx512-vnni" and avx2.qgemm_isa == "avx2"
    rng = np.random.default_rng(ggml_type * 100 + m)
    n, k = 200, 576

    def weight() -> QuantWeight:
        w = rng.standard_normal((n, k)).astype(np.float32) * 0.05
        return QuantWeight(ggml_type, n, k, gguf.quants.quantize(w, gguf.GGMLQuantizationType(ggml_type)))

    gate, up = weight(), weight()
    x = torch.randn(m, k, generator=_gen(m)).to(torch.bfloat16)
    for out_dtype in (torch.float32, torch.bfloat16):
        got = [kk.qlinear(x, kk.qpack(ggml_type, gate.blocks, n, k), n, out_dtype=out_dtype) for kk in (NATIVE, avx2)]
        _same_bits(*got)
    got = [kk.qlinear(x, kk.qpack(ggml_type, gate.blocks, n, k, up=up.blocks), n, swiglu=True)
           for kk in (NATIVE, avx2)]
    _same_bits(*got)
