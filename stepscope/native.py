"""Native code built on first use: C sources compiled with the system compiler into a shared library,
once per sources, flags, compiler (and whatever else the caller puts in the key), written by an atomic
rename so that concurrent processes never load a half-written file. The engine's kernels and the
collector's span decoder both build through here."""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path


def kernel_dir() -> Path:
    """Where built libraries are kept: `$STEPSCOPE_KERNEL_DIR`, default `~/.cache/stepscope/kernels`."""
    default = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "stepscope" / "kernels"
    return Path(os.environ.get("STEPSCOPE_KERNEL_DIR", default))


def build_library(
    name: str, sources: list[Path], flags: list[str], timeout_s: float, extra_key: bytes = b""
) -> Path:
    """Compile `sources` into `<kernel_dir>/<name>-<key>.so` unless it is there; its path. RuntimeError
    when there is no compiler (`$CC`, default `cc`) or the build fails."""
    compiler = shutil.which(os.environ.get("CC", "cc"))
    if compiler is None:
        raise RuntimeError("no C compiler (cc) on PATH")
    key = hashlib.sha256()
    for part in [src.read_bytes() for src in sources] + [" ".join(flags).encode(), compiler.encode()]:
        key.update(part)
    key.update(extra_key)
    target = kernel_dir() / f"{name}-{key.hexdigest()[:16]}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=target.parent, suffix=".so.tmp")
    os.close(fd)
    try:
        done = subprocess.run(
            [compiler, *flags, "-o", tmp, *map(str, sources), "-lm"],
            capture_output=True,
            text=True,
            timeout=timeout_s,
        )
        if done.returncode != 0:
            raise RuntimeError(f"{compiler} failed: {done.stderr.strip()[-500:]}")
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target
