"""Compile the kernel sources (cpu_kernels.cpp, gemm.cpp, qgemm.cpp, stack.cpp and the headers they share)
into one library, once per machine and source version, and load it with ctypes.

The library is built with the system C++ compiler into a cache folder
($KVFENCE_CACHE_DIR, else $XDG_CACHE_HOME/kvfence, else ~/.cache/kvfence), named by a hash
of the source, the compiler and this CPU's feature flags (it is built with -march=native).
Several processes starting at once (a PD cluster) take a file lock, so one builds and the
others load its result. No compiler, or a failed build, means no library: the model then
runs its plain-torch path and says so once in the log.

KVFENCE_KERNELS_ISA=avx2 or =baseline builds for less than this CPU has (x86-64-v3: AVX2 + FMA;
x86-64-v2: no AVX at all), so a machine with AVX-512 also runs and tests the narrower paths that
other machines take (tests/unit/test_kernel_isas.py).
"""
from __future__ import annotations

import ctypes
import fcntl
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

log = logging.getLogger("kvfence.kernels")

SOURCES = [Path(__file__).with_name(name) for name in ("cpu_kernels.cpp", "gemm.cpp", "qgemm.cpp", "stack.cpp")]
HEADERS = [Path(__file__).with_name(name)
           for name in ("kernels.h", "scalar_math.h", "simd_bf16.h", "simd_avx2.h", "simd_vec.h")]
FLAGS = ["-O3", "-mprefer-vector-width=512", "-fopenmp", "-shared", "-fPIC", "-std=c++17", "-fno-math-errno"]
# what KVFENCE_KERNELS_ISA may ask for, as the compiler's target flags
ISAS = {"native": ["-march=native"], "avx2": ["-march=x86-64-v3", "-mtune=native"],
        "baseline": ["-march=x86-64-v2", "-mtune=native"]}


def isa_flags(isa: str | None = None) -> list[str]:
    """The target flags for `isa`, or for $KVFENCE_KERNELS_ISA (default native)."""
    name = isa if isa is not None else os.environ.get("KVFENCE_KERNELS_ISA", "native").strip().lower() or "native"
    if name not in ISAS:
        raise RuntimeError(f"KVFENCE_KERNELS_ISA={name!r}: expected one of {', '.join(ISAS)}")
    return ISAS[name]


def cache_dir() -> Path:
    root = os.environ.get("KVFENCE_CACHE_DIR")
    if root:
        return Path(root)
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "kvfence"


def _compiler() -> str | None:
    for name in (os.environ.get("CXX"), "g++", "c++", "clang++"):
        if name and shutil.which(name):
            return shutil.which(name)
    return None


def cpu_flags() -> set[str]:
    """This CPU's feature flags as /proc/cpuinfo names them (empty where it says none)."""
    line = _cpu_flags()
    return set(line.split(":", 1)[1].split()) if ":" in line else set()


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return os.uname().machine


def library_path(cxx: str, isa: str | None = None) -> Path:
    version = subprocess.run([cxx, "--version"], capture_output=True, text=True).stdout
    sources = b"".join(src.read_bytes() for src in SOURCES + HEADERS)
    key = hashlib.sha256(sources + " ".join(FLAGS + isa_flags(isa)).encode() + version.encode()
                         + _cpu_flags().encode()).hexdigest()[:16]
    return cache_dir() / f"cpu_kernels-{key}.so"


def build(isa: str | None = None) -> Path:
    """Path of the compiled library, building it if this machine has none yet."""
    cxx = _compiler()
    if cxx is None:
        raise RuntimeError("no C++ compiler (g++, c++ or clang++) on PATH")
    target = library_path(cxx, isa)
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / "build.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if target.exists():  # another process built it while we waited
            return target
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
        os.close(fd)
        try:
            proc = subprocess.run([cxx, *FLAGS, *isa_flags(isa), *map(str, SOURCES), "-o", tmp],
                                  capture_output=True, text=True)
            if proc.returncode != 0:
                names = " ".join(src.name for src in SOURCES)
                raise RuntimeError(f"{cxx} failed building {names}:\n{proc.stderr[-2000:]}")
            os.replace(tmp, target)  # atomic: a reader never sees half a library
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    log.info("built CPU kernels: %s", target)
    return target


def load_library(isa: str | None = None) -> ctypes.CDLL:
    # torch first: the library's OpenMP symbols then bind to the runtime torch loaded,
    # so both share one thread pool instead of two pools fighting over the cores
    import torch  # noqa: F401
    lib = ctypes.CDLL(str(build(isa)))  # RTLD_LOCAL: builds for two ISAs can sit in one process
    i64, i32, f32, vp = ctypes.c_int64, ctypes.c_int, ctypes.c_float, ctypes.c_void_p
    lib.kvfence_kernels_version.restype = i32
    lib.kvfence_add_rms_norm.argtypes = [i32, vp, vp, vp, vp, i64, i64, f32, i32]
    lib.kvfence_add_rms_norm.restype = None
    lib.kvfence_add_rms_norm_f32res.argtypes = [vp, vp, vp, vp, i64, i64, f32, i32]
    lib.kvfence_add_rms_norm_f32res.restype = None
    lib.kvfence_rope_store.argtypes = [i32, vp, i64, i64, i32, i32, i32, vp, i64, vp, vp, vp, vp, i64, vp, i32, i32]
    lib.kvfence_rope_store.restype = i64
    lib.kvfence_silu_mul.argtypes = [i32, vp, vp, i64, i64, i32]
    lib.kvfence_silu_mul.restype = None
    lib.kvfence_paged_attention.argtypes = [i32, vp, i64, vp, vp, i64, i64, vp, i64, vp, vp, vp, i64, i64, vp,
                                            i64, i32, i32, i32, i32, f32, i32]
    lib.kvfence_paged_attention.restype = i64
    lib.kvfence_argmax_rows.argtypes = [vp, i64, i64, vp, i32]
    lib.kvfence_argmax_rows.restype = None
    lib.kvfence_apply_token_mask.argtypes = [vp, i64, i64, vp, i64, vp, i64, i32]
    lib.kvfence_apply_token_mask.restype = i64
    lib.kvfence_gemm_supported.restype = i32
    lib.kvfence_gemm_packed_size.argtypes = [i64, i64]
    lib.kvfence_gemm_packed_size.restype = i64
    lib.kvfence_gemm_pack.argtypes = [vp, i64, i64, vp]
    lib.kvfence_gemm_pack.restype = None
    lib.kvfence_gemm.argtypes = [vp, i64, vp, vp, i64, i64, i64, i64, i32]
    lib.kvfence_gemm.restype = i32
    lib.kvfence_gemm_f32.argtypes = [vp, i64, vp, vp, i64, i64, i64, i64, i32]
    lib.kvfence_gemm_f32.restype = i32
    lib.kvfence_gemm_gated_packed_size.argtypes = [i64, i64]
    lib.kvfence_gemm_gated_packed_size.restype = i64
    lib.kvfence_gemm_pack_gated.argtypes = [vp, vp, i64, i64, vp]
    lib.kvfence_gemm_pack_gated.restype = None
    lib.kvfence_gemm_swiglu.argtypes = [vp, i64, vp, vp, i64, i64, i64, i64, i32]
    lib.kvfence_gemm_swiglu.restype = i32
    lib.kvfence_qgemm_supported.restype = i32
    lib.kvfence_qpack_size.argtypes = [i32, i64, i64, i32]
    lib.kvfence_qpack_size.restype = i64
    lib.kvfence_qpack.argtypes = [i32, vp, vp, i64, i64, i64, vp, i64]
    lib.kvfence_qpack.restype = i32
    for name in ("kvfence_qgemm", "kvfence_qgemm_f32", "kvfence_qgemm_swiglu"):
        getattr(lib, name).argtypes = [vp, i64, vp, i64, vp, i64, i64, i64, i64, i32]
        getattr(lib, name).restype = i32
    lib.kvfence_decoder_stack.argtypes = [vp, vp, vp, vp, vp, vp, vp, vp, i32]
    lib.kvfence_decoder_stack.restype = i64
    return lib


if __name__ == "__main__":  # scripts/setup.sh builds them once, ahead of the first model load
    print(f"CPU kernels: {build()}")
