"""Collectives in compiled XLA HLO text, as ``jax.jit(f).lower(*args).compile().as_text()`` prints it.

One parser for the distributed tests (``tests/dist_workers.py``), ``scripts/multi_gpu.py`` and the
notebooks. An instruction is one line, ``%name = TYPE opcode(operands), attributes``:

- a synchronous all-reduce is typed as its result: one array, or a tuple when XLA's combiner merged
  several reductions into one instruction (dW and dB as ``(f32[N], f32[N])``); each array counts;
- an asynchronous ``all-reduce-start`` is counted once, for the arrays it reduces: its operands. Its
  type is the result's, or ``(operands, results)``, twice as many arrays as operands; the matching
  ``all-reduce-done`` is not counted again. The same holds for the other ``-start``/``-done`` pairs;
- operands are printed with their types (``f32[16]{0} %a``) or without (``%a``); typed operands are
  read directly, untyped ones by their count.

    >>> collectives("%ar = (f32[16]{0}, bf16[16]{0}) all-reduce(%a, %b), to_apply=%add")["all_reduce_bytes"]
    96
"""
from __future__ import annotations

import math
import re

# type, opcode, operands of one instruction; a tuple type may nest ("((f32[4], f32[4]), (...))").
_INSTRUCTION = re.compile(r"=\s*(?P<type>\(.*?\)|\S+)\s+(?P<opcode>[a-z][\w-]*)\((?P<operands>[^)]*)\)")
_ARRAY = re.compile(r"\b([a-z][a-z0-9]*)\[([\d,]*)\]")
COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")


def _arrays(text: str) -> list[tuple[str, tuple[int, ...]]]:
    return [(dtype, tuple(int(d) for d in dims.split(",") if d)) for dtype, dims in _ARRAY.findall(text)]


def _bytes(dtype: str, dims: tuple[int, ...]) -> int:
    """Bytes of one array; the element width is the number in the type's name (``pred``: one byte)."""
    bits = 8 if dtype == "pred" else int(re.search(r"\d+", dtype).group())
    return math.prod(dims) * bits // 8


def _reduced(type_text: str, operand_text: str, is_start: bool) -> list[tuple[str, tuple[int, ...]]]:
    """The arrays one all-reduce reduces."""
    typed = _arrays(operand_text)
    if typed:
        return typed
    results = _arrays(type_text)
    n_operands = operand_text.count("%")
    if is_start and n_operands and len(results) == 2 * n_operands:
        return results[n_operands:]  # typed (operands, results)
    return results


def _gathered(type_text: str, operand_text: str, is_start: bool) -> list[tuple[str, tuple[int, ...]]]:
    """The arrays one all-gather delivers: its result (an async start typed ``(operands, results)``:
    the second half)."""
    results = _arrays(type_text)
    n_operands = len(_arrays(operand_text)) or operand_text.count("%")
    if is_start and n_operands and len(results) >= 2 * n_operands:
        return results[n_operands:2 * n_operands]
    return results


def collectives(hlo_text: str, param_shape: tuple[int, ...] | None = None) -> dict:
    """Counts of each collective in ``hlo_text`` (async ``-start`` forms once, ``-done`` never), and
    per all-reduce what it reduces:

    - ``all_reduce_ops``: all-reduce instructions; ``all_gather``, ``reduce_scatter``, ``all_to_all``,
      ``collective_permute``: instructions of each;
    - ``all_reduce_arrays``: every reduced array, e.g. ``"f32[16]"`` (a merged all-reduce lists each);
    - ``all_reduce_elements``: per all-reduce, the elements it reduces (summed over a merged tuple);
    - ``all_reduce_bytes``: the bytes all the all-reduces reduce;
    - ``all_reduce_lines``: the instructions themselves, shortened, to read what XLA did;
    - ``all_gather_arrays``: every array an all-gather delivers, e.g. ``"f32[16]"`` for a gathered
      weight of 16 elements (an activation gathered shows up as an activation-sized array);
    - with ``param_shape``, ``param_reductions``: the reduced arrays of that shape.
    """
    counts = dict.fromkeys(COLLECTIVES, 0)
    arrays, elements, nbytes, lines, gathered = [], [], 0, [], []
    for m in _INSTRUCTION.finditer(hlo_text):
        opcode = m["opcode"]
        base = opcode.removesuffix("-start")
        if base not in counts:
            continue  # other instructions, and every -done
        counts[base] += 1
        if base == "all-gather":
            gathered += [f"{dtype}[{','.join(map(str, dims))}]"
                         for dtype, dims in _gathered(m["type"], m["operands"], opcode != base)]
        if base != "all-reduce":
            continue
        reduced = _reduced(m["type"], m["operands"], opcode != base)
        arrays += [f"{dtype}[{','.join(map(str, dims))}]" for dtype, dims in reduced]
        elements.append(sum(math.prod(dims) for _, dims in reduced))
        nbytes += sum(_bytes(dtype, dims) for dtype, dims in reduced)
        start = hlo_text.rfind("\n", 0, m.start()) + 1
        end = hlo_text.find("\n", m.end())
        lines.append(hlo_text[start:None if end < 0 else end].strip()[:300])
    out = {"all_reduce_ops": counts["all-reduce"], "all_gather": counts["all-gather"],
           "reduce_scatter": counts["reduce-scatter"], "all_to_all": counts["all-to-all"],
           "collective_permute": counts["collective-permute"], "all_reduce_arrays": arrays,
           "all_reduce_elements": elements, "all_reduce_bytes": nbytes, "all_reduce_lines": lines,
           "all_gather_arrays": gathered}
    if param_shape is not None:
        suffix = f"[{','.join(map(str, param_shape))}]"
        out["param_reductions"] = sum(a.endswith(suffix) for a in arrays)
    return out
