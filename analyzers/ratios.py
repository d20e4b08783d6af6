"""A ratio that always travels with its numerator, denominator and the denominator's unit.

docs/DESIGN.md, "Token accounting": every ratio that leaves kvscope prints
``6,144 / 8,191 lookup tokens (75.0 %)``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

Level = Literal["request", "token", "byte"]


@dataclass(slots=True, frozen=True)
class Ratio:
    """numerator / denominator in `unit`.

    Attributes:
        key: stable machine name (JSON, comparisons), e.g. ``token_hit_share``.
        label: what it measures, for people.
        numerator, denominator: integer counts.
        unit: the denominator's unit, e.g. ``lookup tokens``.
        level: ``request``, ``token`` or ``byte``.
        tier: the tier it concerns, when one.
        numerator_unit: set when the numerator has another unit than the denominator (then
            the ratio is a rate such as bytes per token, not a share).
    """

    key: str
    label: str
    numerator: int
    denominator: int
    unit: str
    level: Level
    tier: str | None = None
    numerator_unit: str | None = None

    @property
    def is_share(self) -> bool:
        return self.numerator_unit is None

    @property
    def value(self) -> float | None:
        """numerator / denominator, or None when the denominator is 0."""
        return self.numerator / self.denominator if self.denominator else None

    def __str__(self) -> str:
        v = self.value
        if self.is_share:
            pct = "n/a" if v is None else f"{100 * v:.1f} %"
            return f"{self.numerator:,} / {self.denominator:,} {self.unit} ({pct})"
        per = "n/a" if v is None else f"{v:,.1f} {self.numerator_unit} each"
        return (f"{self.numerator:,} {self.numerator_unit} / {self.denominator:,} {self.unit} "
                f"({per})")

    def to_dict(self) -> dict[str, Any]:
        """``{key, label, numerator, denominator, unit, level, tier, numerator_unit, value}``."""
        return {"key": self.key, "label": self.label, "numerator": self.numerator,
                "denominator": self.denominator, "unit": self.unit, "level": self.level,
                "tier": self.tier, "numerator_unit": self.numerator_unit, "value": self.value}
