"""The collectives in compiled HLO text (``jax.jit(f).lower(...).compile().as_text()``).

``collectives(hlo_text)`` lists every array that a collective instruction delivers:

    >>> hlo = '''
    ... %ar = (f32[16]{0}, bf16[8]{0}) all-reduce(%a, %b), channel_id=1, to_apply=%add
    ... %ag-start = (f32[2,16]{1,0}, f32[4,16]{1,0}) all-gather-start(f32[2,16]{1,0} %c), dimensions={0}
    ... %ag-done = f32[4,16]{1,0} all-gather-done(%ag-start)
    ... '''
    >>> [(c.kind, c.dtype, c.shape, c.elements) for c in collectives(hlo)]
    [('all-reduce', 'f32', (16,), 16), ('all-reduce', 'bf16', (8,), 8), ('all-gather', 'f32', (4, 16), 64)]

- One entry per delivered array: XLA may merge several all-reduces into one instruction of tuple
  type (dW and dB together), whose arrays share ``instruction``; count elements, not instructions.
- Asynchronous pairs count once, at their ``-start``: a start typed ``(operands..., results...)``
  (all-gather-start, an all-reduce-start on some backends, collective-permute-start with its
  context scalars after them) delivers its results; ``-done`` is skipped.
- Kinds: all-reduce, all-gather, reduce-scatter, all-to-all, ragged-all-to-all,
  collective-permute, collective-broadcast.
"""
from __future__ import annotations

import dataclasses
import math
import re

KINDS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "ragged-all-to-all", "collective-permute",
         "collective-broadcast")
_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%?(\S+)\s*=\s*(.+?)\s+(" + "|".join(KINDS) + r")(-start)?\((.*)$",
                          re.MULTILINE)
_ARRAY = re.compile(r"\b([a-z][a-z0-9]*)\[([\d,]*)\]")


@dataclasses.dataclass(frozen=True)
class Collective:
    kind: str  # one of KINDS (an async "-start" under its synchronous name)
    dtype: str  # HLO element type: "f32", "bf16", ...
    shape: tuple[int, ...]  # the array delivered
    instruction: str  # the HLO instruction's name; the arrays of one merged instruction share it

    @property
    def elements(self) -> int:
        return math.prod(self.shape)


def _arrays(text: str) -> list[tuple[str, tuple[int, ...]]]:
    return [(dtype, tuple(int(d) for d in dims.split(",") if d)) for dtype, dims in _ARRAY.findall(text)]


def _operand_count(rest: str) -> int:
    """Operands of ``kind(...)``: the text up to the matching parenthesis, split at top-level commas."""
    depth, end = 1, len(rest)
    for i, ch in enumerate(rest):
        depth += {"(": 1, ")": -1}.get(ch, 0)
        if depth == 0:
            end = i
            break
    operands = rest[:end]
    return operands.count("%") or len(_arrays(operands))


def collectives(hlo_text: str) -> list[Collective]:
    """Every array a collective instruction of ``hlo_text`` delivers, in program order."""
    out = []
    for m in _INSTRUCTION.finditer(hlo_text):
        name, result_type, kind, start, rest = m.groups()
        arrays = _arrays(result_type)
        n = _operand_count(rest)
        if start and n and len(arrays) >= 2 * n:  # (operands..., results..., [context]): what it delivers
            arrays = arrays[n:2 * n]
        out.extend(Collective(kind, dtype, shape, name) for dtype, shape in arrays)
    return out
