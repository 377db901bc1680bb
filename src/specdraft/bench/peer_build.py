"""`make peers`: build llama.cpp, the benchmark's outside peer, once, into the specdraft cache.

The source is the sdist of llama-cpp-python on the package index (its `vendor/llama.cpp`), pinned, so that the
peer is the same program on every machine: `pip download --no-binary :all: --no-deps` fetches the archive (the
package is never installed), cmake builds only `llama-server`, `llama-bench` and `llama-quantize` (Release,
GGML_NATIVE=ON, static libraries, no HTTPS, no web UI download), and the binaries are copied to
`<cache>/peers/llama.cpp-<version>/bin/`. The marker `peer.json` is written last: a folder without it is never
trusted and is rebuilt. A new build replaces the old folder only once it is complete. About 10 minutes on the 2-core
machine.

    python -m specdraft.bench.peer_build [--cache-dir DIR] [--jobs N] [--force]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

from ..errors import SpecdraftError
from .peers import PEER_BINARIES, PEER_PACKAGE, PEER_TOOLS, PEER_VERSION, peer_binary, peer_dir, peer_marker

# Everything off that the two tools do not need, and everything off that would reach the network at build time
# (the server's web UI is fetched from a Hugging Face bucket unless told not to). This llama.cpp has no curl
# option any more (LLAMA_CURL is only a deprecation warning); LLAMA_OPENSSL=OFF is its "no HTTPS".
CMAKE_FLAGS = (
    "-DCMAKE_BUILD_TYPE=Release",
    "-DGGML_NATIVE=ON",
    "-DBUILD_SHARED_LIBS=OFF",
    "-DLLAMA_OPENSSL=OFF",
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_EXAMPLES=OFF",
    "-DLLAMA_BUILD_UI=OFF",
    "-DLLAMA_USE_PREBUILT_UI=OFF",
)
# On a CPU with AMX-INT8, this llama.cpp's AMX kernels stop the process with SIGILL at their first tile instruction
# (`tilezero` in ggml_backend_amx_mul_mat, in any pass of 2 or more tokens; seen on a Xeon, model 207, Linux guest,
# 2026-12-05; upstream: ggml-org/llama.cpp pull request 26954), so the peer is built without them there and runs its
# AVX-512 repacked kernels, as it does on every Xeon without AMX.
NO_AMX = "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"


def cmake_flags(cpu: set[str] | None = None) -> tuple[str, ...]:
    """CMAKE_FLAGS, plus the compiler flags that leave AMX out where the CPU (its flags; default: this one's) has it."""
    from ..models.native.kernels import cpu_flags

    cpu = cpu_flags() if cpu is None else cpu
    if "amx_int8" in cpu or "amx_tile" in cpu:
        return (*CMAKE_FLAGS, f"-DCMAKE_C_FLAGS={NO_AMX}", f"-DCMAKE_CXX_FLAGS={NO_AMX}")
    return CMAKE_FLAGS


def _say(message: str) -> None:
    print(f"[peers] {message}", flush=True)


def _run(cmd: list[str], cwd: Path | None = None) -> None:
    _say("$ " + " ".join(cmd))
    proc = subprocess.run(cmd, cwd=cwd)
    if proc.returncode != 0:
        raise SpecdraftError(f"`{' '.join(cmd[:4])} ...` failed (exit {proc.returncode}); see the output above")


def download_sdist(dest: Path) -> Path:
    """The pinned sdist as an archive in `dest` (pip prepares its metadata in an isolated environment; nothing is
    installed here)."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-binary", ":all:", "--no-deps", "-d", str(dest),
           f"{PEER_PACKAGE}=={PEER_VERSION}"]
    _run(cmd)
    archives = sorted(dest.glob(f"{PEER_PACKAGE.replace('-', '_')}-{PEER_VERSION}.tar.gz"))
    if not archives:
        raise SpecdraftError(f"pip downloaded no sdist of {PEER_PACKAGE}=={PEER_VERSION} into {dest}")
    return archives[0]


def extract_llama_cpp(archive: Path, dest: Path) -> Path:
    """Unpack the archive's `vendor/llama.cpp` (members outside it are skipped; no absolute or `..` paths)."""
    with tarfile.open(archive) as tar:
        members = [m for m in tar.getmembers() if "/vendor/llama.cpp/" in m.name + "/"]
        tar.extractall(dest, members=members, filter="data")
    found = sorted(dest.glob("*/vendor/llama.cpp/CMakeLists.txt"))
    if not found:
        raise SpecdraftError(f"{archive.name} holds no vendor/llama.cpp/CMakeLists.txt")
    return found[0].parent


def build(cache: Path, jobs: int = 2, force: bool = False) -> Path:
    """Build the peer into the cache unless its marker is there; returns the peer folder."""
    folder = peer_dir(cache)
    flags = cmake_flags()
    if peer_marker(cache).is_file() and not force:
        built_with = json.loads(peer_marker(cache).read_text()).get("cmake_flags")
        missing = [name for name in PEER_TOOLS if not peer_binary(cache, name).is_file()]
        if built_with == list(flags):
            if missing:  # built by an earlier version: the peer runs as it is
                _say(f"llama.cpp {PEER_VERSION} is built in {folder}, without {', '.join(missing)} (only needed to "
                     f"make GGUF files of other formats: --force rebuilds with it)")
            else:
                _say(f"llama.cpp {PEER_VERSION} is already built in {folder} (remove it, or --force, to rebuild)")
            return folder
        _say("the peer was built with other cmake flags: rebuilding")
    if shutil.which("cmake") is None:
        raise SpecdraftError("cmake is not installed, and llama.cpp needs it to build: install cmake (Debian: "
                             "`apt-get install cmake`), and a C/C++ compiler, then rerun `make peers`")
    if shutil.which("c++") is None and shutil.which("g++") is None and shutil.which("clang++") is None:
        raise SpecdraftError("no C++ compiler found (c++, g++ or clang++); install one (Debian: "
                             "`apt-get install build-essential`) and rerun `make peers`")
    started = time.perf_counter()
    folder.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="llama.cpp-build-", dir=folder.parent) as work_name:
        work = Path(work_name)
        _say(f"downloading the sdist of {PEER_PACKAGE}=={PEER_VERSION} (about 77 MB)")
        archive = download_sdist(work / "download")
        _say(f"extracting vendor/llama.cpp from {archive.name}")
        source = extract_llama_cpp(archive, work / "src")
        build_dir = work / "build"
        generator = ["-G", "Ninja"] if shutil.which("ninja") else []
        _say("configuring with cmake")
        _run(["cmake", "-S", str(source), "-B", str(build_dir), *generator, *flags])
        _say(f"building {', '.join(PEER_BINARIES + PEER_TOOLS)} with {jobs} jobs (about 10 minutes on 2 cores)")
        _run(["cmake", "--build", str(build_dir), "--config", "Release", "-j", str(jobs),
              "--target", *PEER_BINARIES, *PEER_TOOLS])
        # the new folder, put in place of the old one only once complete: a rebuild that fails (or is offline)
        # leaves a working peer as it was
        staged = work / "peer"
        bin_dir = staged / "bin"
        bin_dir.mkdir(parents=True)
        for name in PEER_BINARIES + PEER_TOOLS:
            built = build_dir / "bin" / name
            if not built.is_file():
                raise SpecdraftError(f"the build produced no {built}")
            shutil.copy2(built, bin_dir / name)
        # the server's README of this very version: the fields the peer reads are documented there
        shutil.copy2(source / "tools" / "server" / "README.md", staged / "server-README.md")
        commit = _vendored_commit(source)
        info = {"package": PEER_PACKAGE, "version": PEER_VERSION, "llama_cpp_commit": commit,
                "cmake_flags": list(flags), "binaries": list(PEER_BINARIES + PEER_TOOLS),
                "built_at": time.strftime("%Y-%m-%d %H:%M:%S"), "build_s": round(time.perf_counter() - started)}
        (staged / peer_marker(cache).name).write_text(json.dumps(info, indent=1) + "\n")  # last: it is complete
        # an unmarked, forced or differently built folder is replaced whole: moved aside into the temporary folder
        # (deleted with it), then the new one renamed into place (a rename fails rather than nesting one in the other)
        if folder.exists():
            folder.rename(work / "replaced")
        staged.rename(folder)
    _say(f"built llama.cpp {PEER_VERSION} ({commit or 'commit unknown'}) in {folder / 'bin'} "
         f"in {time.perf_counter() - started:.0f} s")
    return folder


def _vendored_commit(source: Path) -> str | None:
    """The vendored tree's commit, from the git metadata the sdist ships (None where it has none)."""
    proc = subprocess.run(["git", "-C", str(source), "rev-parse", "HEAD"], capture_output=True, text=True)
    return proc.stdout.strip() or None if proc.returncode == 0 else None


def main(argv: list[str] | None = None) -> int:
    from ..models.fetch import cache_root

    parser = argparse.ArgumentParser(prog="python -m specdraft.bench.peer_build", description=__doc__.split("\n")[0])
    parser.add_argument("--cache-dir", default=None, help="the specdraft cache (default: $SPECDRAFT_CACHE or "
                                                          "~/.cache/specdraft)")
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 2, help="parallel compile jobs (default: "
                                                                               "the CPU count)")
    parser.add_argument("--force", action="store_true", help="rebuild even where the marker is present")
    args = parser.parse_args(argv)
    try:
        build(cache_root(args.cache_dir), jobs=args.jobs, force=args.force)
    except SpecdraftError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
