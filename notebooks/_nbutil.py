"""Shared by the notebooks: the repository on sys.path, the size switch, tables, figures, and where
each number came from.

``NORMKIT_NOTEBOOK_SIZE=smoke|full`` picks the problem sizes; unset, it is ``full`` when CUDA is
available and ``smoke`` otherwise (CPU runs the Triton kernels in the interpreter, which is slow).

Every figure says where its numbers come from: ``Source.of(path)`` reads a committed results file's
device, date and commit (from the file's own metadata, else from ``git log`` of the file, and the
label says which), and ``this_run()`` describes a measurement made where the notebook runs (on a CPU:
the Triton interpreter at smoke size, which checks behaviour and says nothing about speed).
"""
from __future__ import annotations

import datetime
import json
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS_DIR = ROOT / "benchmarks" / "results"
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


# ---------------------------------------------------------------------------------------------
# Tables and display


def _in_notebook() -> bool:
    try:
        from IPython import get_ipython
    except ImportError:
        return False
    return get_ipython() is not None


def table(rows: list[dict], columns: list[str] | None = None):
    """Rows (dicts, or sequences in ``columns`` order) as a pandas DataFrame. Headers carry their
    units, e.g. ``"backward (µs)"``; a missing value is shown as NaN/None."""
    import pandas as pd

    return pd.DataFrame(rows, columns=columns)


def display(obj) -> None:
    """IPython's display inside a notebook; run as a plain script, DataFrames print as text and
    figures are left to matplotlib (the script's own output is the record)."""
    if _in_notebook():
        from IPython.display import display as ipython_display

        ipython_display(obj)
        return
    if obj is None or hasattr(obj, "savefig"):
        return
    if hasattr(obj, "to_string"):
        print(obj.to_string())
    else:
        print(obj)


def show(fig) -> None:
    """Display a finished figure once and close it (so the inline backend does not draw it twice)."""
    import matplotlib.pyplot as plt

    display(fig)
    plt.close(fig)


def environment() -> dict:
    """Versions and devices, shown at the top of each notebook."""
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


# ---------------------------------------------------------------------------------------------
# Where the numbers come from


def _git(*args: str) -> str | None:
    try:
        out = subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None if out.returncode == 0 else None


def _dig(doc, *keys):
    for k in keys:
        if not isinstance(doc, dict) or k not in doc:
            return None
        doc = doc[k]
    return doc


def _first_commit(path: Path) -> str | None:
    """The commit that added ``path`` (under this name)."""
    out = _git("log", "--diff-filter=A", "--format=%h", "--", str(path))
    return out.splitlines()[-1] if out else None


def _commit_date(commit: str) -> str | None:
    return _git("show", "-s", "--format=%cs", commit)


@dataclass(frozen=True)
class Source:
    """A committed results file: the device, date and commit its numbers were measured on.

    ``commit_from_git``: the file records no commit, so ``commit`` is the one that added the file.
    ``date_from_git``: the file records no date, so ``date`` is ``commit``'s (``git show``): the date of
    the code that was measured, or of the commit that added the file. ``None``: neither the file nor git
    knows.
    """

    path: Path
    device: str | None
    date: str | None
    commit: str | None
    dirty: bool = False
    date_from_git: bool = False
    commit_from_git: bool = False

    @property
    def name(self) -> str:
        return str(self.path.relative_to(ROOT)) if self.path.is_relative_to(ROOT) else str(self.path)

    @classmethod
    def of(cls, path, doc: dict | None = None) -> Source:
        """Read the provenance of a results file (the benchmark, device-time, LoRA-step and multi-GPU
        schemas); what the file lacks is taken from ``git log`` and marked so."""
        path = Path(path).resolve()
        if doc is None:
            doc = json.loads(path.read_text())
        prov = doc.get("provenance") or {}
        device = (_dig(doc, "device", "name") if isinstance(doc.get("device"), dict) else doc.get("device")) \
            or _dig(doc, "env", "device_name") or prov.get("machine")
        if device and prov.get("machine") == device:
            device = device.split(" (")[0]  # "2 x NVIDIA H200 (lent kind), torch ..." -> "2 x NVIDIA H200"
        dates = sorted({str(r.get("started", ""))[:10] for r in doc.get("runs", []) if r.get("started")})
        date = " to ".join(dict.fromkeys([dates[0], dates[-1]])) if dates else (prov.get("date") or doc.get("date"))
        commit = _dig(doc, "versions", "git") or _dig(doc, "env", "versions", "git")
        if not commit:
            found = re.search(r"\bcommit ([0-9a-f]{7,40})\b", " ".join(str(v) for v in prov.values()))
            commit = found.group(1) if found else None
        dirty = bool(_dig(doc, "versions", "git_dirty"))
        date_from_git = commit_from_git = False
        if not commit:
            commit = _first_commit(path)
            commit_from_git = commit is not None
        if not date and commit:
            date = _commit_date(commit)
            date_from_git = date is not None
        return cls(path, device, date, commit, dirty, date_from_git, commit_from_git)

    def label(self, with_name: bool = True) -> str:
        """One line for a figure or a table caption (``with_name=False``: without the file's name, for a
        caption that names the folder instead)."""
        date = (self.date or "date not recorded") + (" (the file records no date: its commit's)"
                                                      if self.date_from_git else "")
        if self.commit is None:
            commit = "commit not recorded"
        elif self.commit_from_git:
            commit = f"added to the repository in {self.commit} (the file records no commit)"
        else:
            commit = f"commit {self.commit}" + (" with local changes" if self.dirty else "")
        where = f"{self.device or 'device not recorded'}, {date}, {commit}"
        return f"{where}: {self.name}" if with_name else where


def this_run(size: str, what: str = "measured in this run", on: str | None = None) -> str:
    """How a measurement made where the notebook runs should be read: the device (``on`` overrides it),
    the size, today's date and the checkout's commit; on a CPU, that it says nothing about speed."""
    import torch

    when = datetime.date.today().isoformat()
    commit = _git("rev-parse", "--short", "HEAD")
    if commit:  # executed notebooks (.ipynb) do not count as changes: they are this run's output
        changed = _git("status", "--porcelain", "--untracked-files=no", "--", ".", ":(exclude)*.ipynb")
        when += f", commit {commit}" + (" with local changes" if changed else "")
    if on is not None:
        return f"{what} on {on} ({size} size), {when}"
    if torch.cuda.is_available():
        return f"{what} on {torch.cuda.get_device_name(0)} ({size} size), {when}"
    return (f"{what} on the CPU in Triton's interpreter ({size} size), {when}: "
            "an interpreter smoke run that checks behaviour and says nothing about speed")


# ---------------------------------------------------------------------------------------------
# Figures


def grouped_bars(ax, groups: list[str], series: dict[str, list], *, colors: dict | None = None,
                 hatches: dict | None = None, annotate: str | None = None, width: float = 0.8,
                 headroom: float = 1.35) -> None:
    """A cluster of bars per group, one bar per series (``series[name][i]`` belongs to ``groups[i]``;
    None or NaN leaves a gap). ``annotate``: a format for the value above each bar, e.g. ``"{:.0f}"``.
    The y axis gets ``headroom`` above the tallest bar, where a legend fits (``loc="upper ..."``); set a
    log scale on ``ax`` before the call."""
    import math

    n = max(len(series), 1)
    w = width / n
    for k, (name, values) in enumerate(series.items()):
        xs = [i - width / 2 + (k + 0.5) * w for i in range(len(groups))]
        ys = [math.nan if v is None else v for v in values]
        bars = ax.bar(xs, ys, w, label=name, color=(colors or {}).get(name), hatch=(hatches or {}).get(name),
                      edgecolor="black" if (hatches or {}).get(name) else None, linewidth=0.5)
        if annotate:
            for bar, y in zip(bars, ys):
                if not math.isnan(y):
                    ax.annotate(annotate.format(y), (bar.get_x() + bar.get_width() / 2, y), ha="center",
                                va="bottom", fontsize=7, rotation=90 if n > 3 else 0, xytext=(0, 2),
                                textcoords="offset points")
    ax.set_xticks(range(len(groups)), groups)
    ax.grid(alpha=0.3, axis="y")
    values = [v for vs in series.values() for v in vs if v is not None and not math.isnan(v)]
    top, bottom = max(values, default=0), min(values, default=0)
    if top > 0:
        ax.set_ylim(top=top * headroom)  # room for the legend above the bars
    if bottom < 0:
        ax.set_ylim(bottom=bottom * 1.2)


def footnote(fig, text: str) -> None:
    """Where the figure's numbers come from, under the figure."""
    fig.text(0.0, 0.0, text, fontsize=7.5, ha="left", va="top", color="0.25", wrap=True,
             transform=fig.transFigure)
