"""Execute the notebooks from their jupytext sources and save them with their outputs.

    python notebooks/build.py --size full         # on a GPU: every NN_*.py -> NN_*.ipynb beside it
    python notebooks/build.py 01                  # one notebook (a name prefix), at the machine's size
    python notebooks/build.py --check             # execute every notebook at smoke size, write nothing

The ``.py`` (py:percent) file is the source; the ``.ipynb`` beside it is the committed notebook with its
full-size outputs (run on a GPU), so tables and figures show wherever the repository is viewed. Only a
full-size build writes there. At smoke size (the default on a CPU, where the kernels run in Triton's
interpreter) the executed notebooks go to ``build/notebooks/`` (git-ignored) unless ``--out`` names
another folder, so a CPU run never replaces the GPU outputs. Kernels are the current interpreter's
``python3`` (jupyter_client maps its ``python`` to ``sys.executable``), started in notebooks/ with the
repository root on PYTHONPATH and ``NORMKIT_NOTEBOOK_SIZE`` set. Each notebook's time is printed; a
notebook that fails is reported (with its failing cell) and not written, and the others still run;
the exit status is 1 if any failed.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))
from _nbutil import notebook_size  # noqa: E402  (NORMKIT_NOTEBOOK_SIZE, else full where CUDA is available)

SMOKE_OUT = ROOT / "build" / "notebooks"  # where smoke-size builds go by default


def output_dir(size: str, out: Path | None) -> Path:
    """Where executed notebooks go: ``out``; else beside their sources at full size, SMOKE_OUT at smoke size."""
    return out if out is not None else (HERE if size == "full" else SMOKE_OUT)


def sources(names=()) -> list[Path]:
    """notebooks/NN_*.py, optionally only those whose name starts with one of ``names``."""
    found = sorted(p for p in HERE.glob("[0-9][0-9]_*.py"))
    if names:
        found = [p for p in found if any(p.stem.startswith(n) or p.name == n for n in names)]
    return found


def execute(source: Path, size: str | None = None, timeout: int = 600):
    """Read a py:percent source, run every cell in a fresh kernel (the repository root on its
    PYTHONPATH, NORMKIT_NOTEBOOK_SIZE=``size`` when given), return the executed notebook.

    Raises ``nbclient.exceptions.CellExecutionError`` on the first cell that fails.
    """
    import jupytext
    from nbclient import NotebookClient

    nb = jupytext.read(source)
    for i, cell in enumerate(nb.cells):  # stable ids, so a rebuild only changes what the outputs change
        cell["id"] = f"cell-{i:02d}"
    nb.metadata["kernelspec"] = {"display_name": "Python 3", "language": "python", "name": "python3"}
    paths = [str(ROOT)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(dict.fromkeys(paths))}
    if size is not None:
        env["NORMKIT_NOTEBOOK_SIZE"] = size
    NotebookClient(nb, timeout=timeout, kernel_name="python3", record_timing=False,
                   resources={"metadata": {"path": str(source.parent)}}).execute(env=env)
    return nb


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("names", nargs="*", help="notebook name prefixes, e.g. 01 (default: all)")
    ap.add_argument("--size", choices=("smoke", "full"), default=None,
                    help="NORMKIT_NOTEBOOK_SIZE (default: full when CUDA is available, smoke otherwise)")
    ap.add_argument("--out", type=Path, default=None,
                    help="folder for the executed notebooks (default: beside the sources at full size, "
                         "build/notebooks/ at smoke size)")
    ap.add_argument("--check", action="store_true", help="execute at smoke size, write nothing")
    ap.add_argument("--timeout", type=int, default=600, help="seconds one cell may take (default 600)")
    args = ap.parse_args(argv)
    import jupytext
    from nbclient.exceptions import CellExecutionError

    chosen = sources(args.names)
    if not chosen:
        ap.error(f"no notebook matches {args.names}; have {[p.stem for p in sources()]}")
    size = "smoke" if args.check else (args.size or notebook_size())
    out_dir = output_dir(size, args.out)
    failed, start = [], time.perf_counter()
    for src in chosen:
        t0 = time.perf_counter()
        try:
            nb = execute(src, size, timeout=args.timeout)
        except CellExecutionError as err:
            failed.append(src.name)
            print(f"FAILED {src.name} ({time.perf_counter() - t0:.0f} s):\n{err}", flush=True)
            continue
        took = time.perf_counter() - t0
        if args.check:
            print(f"ok     {src.name} ({took:.0f} s)", flush=True)
            continue
        out_dir.mkdir(parents=True, exist_ok=True)
        out = out_dir / f"{src.stem}.ipynb"
        jupytext.write(nb, out)
        print(f"wrote  {out} ({size} size, {took:.0f} s)", flush=True)
    print(f"{len(chosen) - len(failed)} of {len(chosen)} notebooks in {time.perf_counter() - start:.0f} s"
          + (f"; failed: {', '.join(failed)}" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
