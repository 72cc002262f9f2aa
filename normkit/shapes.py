"""Named shapes, one list for tests and benchmarks, and the one parser of "MxN" strings (``parse``).

``tags``: "ci" (small, CPU-interpretable), "gpu" (compiled test sizes), "bench" (benchmark rows),
"model" (hidden sizes of real models)."""
from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Shape:
    name: str
    shape: tuple[int, ...]  # x's shape; the last dim is normalized
    tags: frozenset
    strided: bool = False  # rows are a slice of a wider buffer (row stride > D)

    @property
    def M(self) -> int:
        m = 1
        for d in self.shape[:-1]:
            m *= d
        return m

    @property
    def N(self) -> int:
        return self.shape[-1]


def _s(name, shape, *tags, strided=False):
    return Shape(name, tuple(shape), frozenset(tags), strided)


SHAPES = [
    # Test shapes: odd D, a single row, many rows, 3-D, strided rows.
    _s("d1", (6, 1), "ci", "gpu"),
    _s("d3", (5, 3), "ci", "gpu"),
    _s("d127", (9, 127), "ci", "gpu"),
    _s("d1000", (4, 1000), "ci", "gpu"),
    _s("d4097", (3, 4097), "ci", "gpu"),
    _s("one_row", (1, 64), "ci", "gpu"),
    _s("many_rows", (300, 48), "ci", "gpu"),
    _s("3d", (2, 5, 40), "ci", "gpu"),
    _s("strided", (7, 96), "ci", "gpu", strided=True),
    # Larger shapes for the compiled test run.
    _s("gpu_rows", (4099, 1536), "gpu"),
    _s("gpu_wide", (64, 65536), "gpu"),
    _s("gpu_3d_strided", (8, 257, 2048), "gpu", strided=True),
    # Benchmark rows (M x N).
    _s("4096x1024", (4096, 1024), "bench"),
    _s("4096x4096", (4096, 4096), "bench"),
    _s("4096x8192", (4096, 8192), "bench"),
    _s("8192x4096", (8192, 4096), "bench"),
    _s("8192x8192", (8192, 8192), "bench"),
    _s("16384x8192", (16384, 8192), "bench"),
    _s("32768x4096", (32768, 4096), "bench"),
    _s("65536x2048", (65536, 2048), "bench"),
    # Hidden sizes of real models at batch*seq = 8192 and 32768.
    _s("llama3-8b_8k", (8192, 4096), "model"),
    _s("llama3-8b_32k", (32768, 4096), "model"),
    _s("qwen2.5-72b_8k", (8192, 8192), "model"),
    _s("qwen2.5-72b_32k", (32768, 8192), "model"),
    _s("gemma2-9b_8k", (8192, 3584), "model"),
    _s("gemma2-9b_32k", (32768, 3584), "model"),
]


def shapes(*tags: str) -> list[Shape]:
    """The shapes with any of ``tags``, each once, in table order."""
    return [s for s in SHAPES if s.tags & set(tags)]


def parse(text: str) -> tuple[int, int]:
    """An ``"MxN"`` string (rows x normalized size, e.g. ``"8192x4096"``) as ``(M, N)``."""
    parts = text.strip().lower().split("x")
    if len(parts) != 2 or not all(p.isdigit() and int(p) > 0 for p in parts):
        raise ValueError(f"shape {text!r} is not MxN with positive integers M and N (e.g. 8192x4096)")
    return int(parts[0]), int(parts[1])


def parse_list(text: str) -> list[tuple[int, int]]:
    """A comma list of ``"MxN"`` strings, each parsed by ``parse``."""
    return [parse(item) for item in text.split(",") if item.strip()]
