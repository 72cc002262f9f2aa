"""The report of a frontend's ``patch_model`` / ``unpatch_model``: what was swapped and what was not, and why."""
from __future__ import annotations

import dataclasses


@dataclasses.dataclass
class PatchReport:
    """What ``patch_model`` (or ``unpatch_model``) did.

    ``patched``: ``(name, old class, new class)`` for each module changed; ``skipped``: ``(name, class,
    reason)`` for each norm-looking module left as it was. A frontend's report may add lines of its own
    (``extra_lines``) and name classes its own way (``class_name``).
    """

    patched: list = dataclasses.field(default_factory=list)
    skipped: list = dataclasses.field(default_factory=list)
    verb: str = "patched"

    def __len__(self) -> int:
        return len(self.patched)

    @staticmethod
    def class_name(cls: type) -> str:
        return cls.__name__

    def extra_lines(self) -> list:
        return []

    def __str__(self) -> str:
        lines = [f"normkit: {self.verb} {len(self.patched)} module(s), skipped {len(self.skipped)}"]
        groups: dict = {}
        for name, old, new in self.patched:
            groups.setdefault((self.class_name(old), self.class_name(new)), []).append(name)
        for (old, new), names in groups.items():
            lines.append(f"  {self.verb} {len(names):3d} x {old} -> {new}: {listed(names)}")
        reasons: dict = {}
        for name, cls, reason in self.skipped:
            reasons.setdefault((self.class_name(cls), reason), []).append(name)
        for (cls, reason), names in reasons.items():
            lines.append(f"  skipped {len(names):3d} x {cls} ({reason}): {listed(names)}")
        return "\n".join(lines + self.extra_lines())

    def _repr_pretty_(self, p, cycle):  # IPython shows the readable form
        p.text(str(self))


def listed(names: list, limit: int = 3) -> str:
    """The first ``limit`` names, and how many more."""
    shown = ", ".join(n or "<root>" for n in names[:limit])
    return shown + (f", ... (+{len(names) - limit})" if len(names) > limit else "")
