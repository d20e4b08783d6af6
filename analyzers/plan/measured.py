"""The recompute cost measured in a run, for `kvscope plan --from-run`.

The cost is the run's fitted step cost model (`analyzers.costmodel.fit_step_cost`): its
per-token cost is the marginal recompute rate. This module opens the run, checks that a model
was fitted, and says which model the run served, so that the plan can say when it is not the
one being planned. pandas is imported when called.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Any

from agent.errors import InputError


@dataclass(slots=True, frozen=True)
class MeasuredPrefill:
    """Recompute throughput measured in a run.

    Attributes:
        run: the run directory.
        tokens_per_s: 1 / the fitted per-token step cost.
        per_token_ns, per_token_ci_ns: the per-token cost and its bootstrap interval.
        fixed_ns: the fitted fixed cost per step.
        steps: the steps the fit used.
        model: the run's model as run.json records it (``model_id``, ``num_layers``,
            ``num_kv_heads``, ``head_dim``; entries it lacks are absent).
    """

    run: str
    tokens_per_s: float
    per_token_ns: float
    per_token_ci_ns: tuple[float, float]
    fixed_ns: float
    steps: int
    model: dict[str, Any]

    def describe(self) -> str:
        lo, hi = self.per_token_ci_ns
        return (f"fitted in {self.run}: {self.per_token_ns / 1e3:,.3f} us per scheduled token "
                f"(95 % CI {lo / 1e3:,.3f} .. {hi / 1e3:,.3f}) + {self.fixed_ns / 1e6:,.3f} ms "
                f"per step over {self.steps:,} steps")

    def model_differs(self, planned: Any) -> str | None:
        """A note when the run's model is not `planned` (an `analyzers.plan.ModelKV`): by
        its KV geometry (layers, KV heads, head size), or by name when the run gives no
        geometry; None when they match or the run does not say."""
        m = self.model
        run_name = m.get("model_id")
        geometry = [("layers", m.get("num_layers"), planned.layers),
                    ("KV heads", m.get("num_kv_heads"), planned.kv_heads),
                    ("head size", m.get("head_dim"), planned.head_dim)]
        known = [(k, r, p) for k, r, p in geometry if r is not None and p is not None]
        diff = [f"{k} {r} vs {p}" for k, r, p in known if r != p]
        if not known and run_name and planned.name and run_name != planned.name:
            diff = [f"model {run_name} vs {planned.name}"]
        if not diff:
            return None
        return (f"--from-run: the run served another model ({run_name or 'unnamed'}; "
                f"{', '.join(diff)} in the run vs the plan): its recompute cost is that "
                "model's on that run's hardware, not the planned model's")


def _run_model(meta: dict[str, Any]) -> dict[str, Any]:
    cfg = meta.get("config") if isinstance(meta.get("config"), dict) else {}
    eng = cfg.get("engine") if isinstance(cfg.get("engine"), dict) else {}
    model = eng.get("model") if isinstance(eng.get("model"), dict) else {}
    out = {k: model[k] for k in ("model_id", "num_layers", "num_kv_heads", "head_dim")
           if k in model}
    if "model_id" not in out and isinstance(cfg.get("model"), str):
        out["model_id"] = cfg["model"]
    return out


def measured_prefill(run: str | os.PathLike[str]) -> MeasuredPrefill:
    """Open `run` and fit its step cost model.

    Args:
        run: a run directory.
    Returns:
        The per-token cost with its interval. Raises `InputError` when the analysis extra is
        missing or the run's steps do not support a fit (the reason is named).
    """
    try:
        from analyzers.costmodel import fit_step_cost
    except ImportError as exc:
        # Only a missing analysis install is the user's to fix; a broken module is a bug.
        missing = getattr(exc, "name", None) in ("pandas", "analyzers.costmodel")
        if isinstance(exc, ModuleNotFoundError) and not missing:
            raise
        raise InputError(f"--from-run needs the analysis extra (analyzers.costmodel: {exc}); "
                         "install kvscope[analysis]") from None
    from agent.runstore.reader import open_run

    store = open_run(run, tables=("requests", "spans"))
    cost = fit_step_cost(store.spans)
    if not (cost.fitted and math.isfinite(cost.per_token_ns) and cost.per_token_ns > 0):
        raise InputError(f"{run}: no recompute cost to take: the step cost model is "
                         f"{cost.describe()}")
    return MeasuredPrefill(str(run), cost.tokens_per_s, cost.per_token_ns, cost.per_token_ci_ns,
                           cost.fixed_ns, cost.steps, _run_model(store.meta))
