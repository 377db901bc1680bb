"""Build (once, cached on disk) and load the C++ kernels of the native forward; report why when impossible."""

from __future__ import annotations

import hashlib
import os
import platform
import shutil
import sys
import time
from pathlib import Path

_SOURCE = Path(__file__).with_name("kernels.cpp")
_SOURCES = (_SOURCE, Path(__file__).with_name("quant_kernels.cpp"))  # one extension; kernels.cpp binds both
_HEADERS = (Path(__file__).with_name("unrolled.h"),)  # included by both: part of the build's fingerprint
# -fopenmp matters: at::parallel_for is a header template that runs sequentially unless the extension itself is
# compiled with OpenMP (it then shares torch's libgomp and follows torch.set_num_threads).
_FLAGS = ["-O3", "-mavx2", "-mfma", "-mf16c", "-fopenmp"]
# The matrix products use 512-bit vectors where the CPU has AVX-512 (twice the multiply-adds per instruction:
# verify passes of several tokens are partly compute-bound); where it also has AVX512-BF16, bf16 weights meet
# bf16-rounded activations in vdpbf16ps (kernels.cpp). SPECDRAFT_KERNELS_ISA=avx2 or avx512 forces a lesser build.
_AVX512_FLAGS = ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq"]
_AVX512_NEEDS = {"avx512f", "avx512bw", "avx512vl", "avx512dq"}
_BF16_FLAGS = ["-mavx512bf16"]
_BF16_NEEDS = {"avx512_bf16"}
# The GGUF block kernels (quant_kernels.cpp) fuse their integer dot products with AVX512-VNNI where an AVX-512
# build runs on a CPU that has it; the sums are the same integers either way, so the results are the same bits.
_VNNI_FLAGS = ["-mavx512vnni"]
_VNNI_NEEDS = {"avx512_vnni"}
# Where the CPU has AMX-INT8 (Intel Xeon since Sapphire Rapids), passes of several tokens over Q4_K, Q6_K, Q8_0 and
# Q5_0 matrices take their integer sums from tile multiplies (quant_kernels.cpp): the same integers, the same bits.
_AMX_FLAGS = ["-mamx-tile", "-mamx-int8"]
_AMX_NEEDS = {"amx_tile", "amx_int8", "avx512_vnni"}
ISAS = ("avx2", "avx512", "avx512bf16", "amx")  # each one's CPU needs include the previous one's
ISA_ENV = "SPECDRAFT_KERNELS_ISA"
_loaded = None
_failure: str | None = None
_startup: dict = {}  # how this process got the kernels: {"kernels": "built" | "imported", "seconds": float}


def cpu_flags() -> set[str]:
    """This CPU's feature flags as /proc/cpuinfo names them (empty where it cannot be read)."""
    try:
        with open("/proc/cpuinfo") as f:
            return set(next((line for line in f if line.startswith("flags")), "").split())
    except OSError:
        return set()


def _missing(isa: str) -> set[str]:
    """CPU flags that `isa` needs and this CPU lacks."""
    needs = {"avx2": set(), "avx512": _AVX512_NEEDS, "avx512bf16": _AVX512_NEEDS | _BF16_NEEDS,
             "amx": _AVX512_NEEDS | _BF16_NEEDS | _AMX_NEEDS}[isa]
    return needs - cpu_flags()


def runnable_isas() -> list[str]:
    """The builds this CPU can run, lesser first."""
    return [isa for isa in ISAS if not _missing(isa)]


def chosen_isa() -> str:
    """"amx", "avx512bf16", "avx512" or "avx2": the CPU's best, unless SPECDRAFT_KERNELS_ISA asks for another."""
    wanted = os.environ.get(ISA_ENV, "auto").strip().lower() or "auto"
    if wanted not in ("auto", *ISAS):
        raise ValueError(f"{ISA_ENV}={wanted!r}: use auto, {', '.join(ISAS)}")
    if wanted == "auto":
        return runnable_isas()[-1]
    if _missing(wanted):
        raise ValueError(f"{ISA_ENV}={wanted}, but this CPU lacks {sorted(_missing(wanted))}")
    return wanted


def _flags() -> list[str]:
    isa = chosen_isa()
    vnni = isa != "avx2" and _VNNI_NEEDS <= cpu_flags()
    return (_FLAGS + (_AVX512_FLAGS if isa != "avx2" else []) + (_BF16_FLAGS if isa in ("avx512bf16", "amx") else [])
            + (_VNNI_FLAGS if vnni else []) + (_AMX_FLAGS if isa == "amx" else []))


def build_dir() -> Path:
    """Compiled artifacts live in the specdraft cache, keyed by the source, Python and torch versions: the
    build (about 30 s) is paid once per machine, later processes import the library directly."""
    import torch

    from .. import fetch

    fingerprint = (b"".join(source.read_bytes() for source in _SOURCES + _HEADERS) + torch.__version__.encode()
                   + " ".join(_flags()).encode())
    key = hashlib.sha256(fingerprint).hexdigest()[:12]
    return fetch.cache_root(None) / "kernels" / f"{sys.implementation.cache_tag}-{key}"


def _import_built(library: Path):
    import importlib.util

    import torch  # noqa: F401  (the extension links against torch's libraries, loaded by this import)

    spec = importlib.util.spec_from_file_location("specdraft_kernels", library)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def load_kernels():
    """The compiled module, or None when this platform cannot have it (see `unavailable_reason`)."""
    global _loaded, _failure
    if _loaded is not None or _failure is not None:
        return _loaded
    if platform.machine() not in ("x86_64", "AMD64") or not {"avx2", "fma"} <= cpu_flags():
        _failure = "the native kernels need an x86-64 CPU with AVX2 and FMA"
        return None
    if shutil.which(os.environ.get("CXX", "c++")) is None:
        _failure = "no C++ compiler found (install g++ or set CXX)"
        return None
    # torch finds ninja on PATH; the one pip installs sits next to this interpreter
    os.environ["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])
    started = time.perf_counter()
    try:
        from torch.utils.cpp_extension import load

        directory = build_dir()
        library = directory / "specdraft_kernels.so"
        if library.is_file():
            _loaded = _import_built(library)
            _startup.update(kernels="imported", seconds=time.perf_counter() - started, isa=_loaded.isa())
            return _loaded
        directory.mkdir(parents=True, exist_ok=True)
        _loaded = load(name="specdraft_kernels", sources=[str(source) for source in _SOURCES], build_directory=str(directory),
                       extra_cflags=_flags(), extra_ldflags=["-fopenmp"], verbose=False)
        _startup.update(kernels="built", seconds=time.perf_counter() - started, isa=_loaded.isa())
    except Exception as exc:  # a compiler or toolchain problem: fall back to transformers, say why
        lines = [line for line in str(exc).splitlines() if line.strip()]
        _failure = f"building the native kernels failed: {lines[-1] if lines else type(exc).__name__}"
    return _loaded


def unavailable_reason() -> str | None:
    load_kernels()
    return _failure


def startup_info() -> dict:
    """The one-off cost of the kernels in this process: built here (once per machine) or imported from the cache."""
    return dict(_startup) if _startup else {"kernels": "unavailable" if _failure else "not loaded"}
