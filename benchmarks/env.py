"""What a results file records about the run: package versions, the commit, and errors in one line."""
from __future__ import annotations

import importlib.metadata
import os
import platform
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DISTRIBUTIONS = ("torch", "triton", "jax", "jaxlib", "numpy", "ml_dtypes", "jax-triton", "liger-kernel",
                 "transformers", "peft", "matplotlib", "pandas", "jax-cuda13-plugin", "jax-cuda12-plugin")


def versions() -> dict:
    """Python's version, each installed distribution of ``DISTRIBUTIONS``, normkit's, and the git commit
    (``git``, short hash) with ``git_dirty`` (tracked files changed since it). A machine that gets a
    copy of the working tree without its history is told the commit by ``NORMKIT_GIT_COMMIT`` (the
    short hash, with ``-dirty`` appended when tracked files had changed)."""
    out = {"python": platform.python_version()}
    for dist in DISTRIBUTIONS:
        try:
            out[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            pass
    try:
        import normkit

        out["normkit"] = normkit.__version__
    except Exception as e:  # noqa: BLE001 (recorded: a results file says what it could not import)
        out["normkit"] = f"import failed: {short_error(e)}"
    out["git"], out["git_dirty"] = None, None
    given = os.environ.get("NORMKIT_GIT_COMMIT")
    if given:
        commit, dirty = given.removesuffix("-dirty"), given.endswith("-dirty")
        out["git"], out["git_dirty"] = commit, dirty
        return out
    try:
        git = ["git", "-C", str(REPO)]
        out["git"] = subprocess.run([*git, "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                    timeout=10).stdout.strip() or None
        out["git_dirty"] = bool(subprocess.run([*git, "status", "--porcelain", "--untracked-files=no"],
                                               capture_output=True, text=True, timeout=10).stdout.strip())
    except (OSError, subprocess.SubprocessError):  # no git on the machine
        pass
    return out


def short_error(e: BaseException, limit: int = 400) -> str:
    """``"TypeName: message"`` on one line, at most ``limit`` characters: how results record a failure."""
    return f"{type(e).__name__}: {e}".strip().replace("\n", " ")[:limit]
