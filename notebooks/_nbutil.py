"""Shared by the notebooks: the repository on sys.path, the size switch, and Markdown tables.

``NORMKIT_NOTEBOOK_SIZE=smoke|full`` picks the problem sizes; unset, it is ``full`` when CUDA is
available and ``smoke`` otherwise (CPU runs the Triton kernels in the interpreter, which is slow).
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
# On a GPU, JAX would otherwise take 75% of its memory up front, leaving little to Torch in the same
# kernel. Import this module before jax.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")


def notebook_size() -> str:
    size = os.environ.get("NORMKIT_NOTEBOOK_SIZE")
    if size:
        if size not in ("smoke", "full"):
            raise ValueError(f"NORMKIT_NOTEBOOK_SIZE={size!r}; expected 'smoke' or 'full'")
        return size
    import torch

    return "full" if torch.cuda.is_available() else "smoke"


def _fmt(v, floatfmt: str) -> str:
    if isinstance(v, float):
        return format(v, floatfmt)
    if isinstance(v, bool):
        return "yes" if v else "no"
    if v is None:
        return "-"
    return str(v).replace("|", "\\|")


def table(rows: list[dict], columns: list[str] | None = None, floatfmt: str = ".3g"):
    """A Markdown table (rendered by Jupyter and by GitHub's notebook viewer). Run as a plain script
    (e.g. on a machine without IPython), the Markdown text is printed instead."""
    if columns is None:
        columns = list(rows[0]) if rows else []
    lines = ["| " + " | ".join(_fmt(c, floatfmt) for c in columns) + " |", "|" + "---|" * len(columns)]
    for r in rows:
        lines.append("| " + " | ".join(_fmt(r.get(c), floatfmt) for c in columns) + " |")
    text = "\n".join(lines)
    try:
        from IPython import get_ipython
        from IPython.display import Markdown
    except ImportError:
        get_ipython = None
    if get_ipython is None or get_ipython() is None:
        print(text)
        return None
    return Markdown(text)


def display(obj) -> None:
    """IPython's display inside a notebook; run as a plain script, tables print as text and figures
    are left to matplotlib (the script's own output is the record)."""
    try:
        from IPython import get_ipython
        from IPython.display import display as ipython_display
    except ImportError:
        get_ipython = None
    if get_ipython is not None and get_ipython() is not None:
        ipython_display(obj)
    elif obj is not None and not hasattr(obj, "savefig"):
        print(obj)


def environment() -> dict:
    """Versions and devices, printed at the top of each notebook."""
    import platform

    import numpy
    import torch
    import triton

    info = {"python": platform.python_version(), "torch": torch.__version__, "triton": triton.__version__,
            "numpy": numpy.__version__,
            "torch device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu (Triton interpreter)"}
    try:
        import jax

        info["jax"] = jax.__version__
        info["jax devices"] = ", ".join(sorted({d.platform for d in jax.devices()}))
    except ImportError:
        pass
    return info
