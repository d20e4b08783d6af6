"""Lint Prometheus rules against what a target actually exposes.

A rule that queries a metric the target never exports evaluates to nothing: an alert that can
never fire, silently. The classic case is a counter queried without its `_total` suffix
(vLLM's own example rules query `vllm:num_preemptions`; the counter is exported as
`vllm:num_preemptions_total`). This module extracts the metric names each rule's PromQL reads,
compares them with the series names of a Prometheus text exposition, and suggests the likely
intended name.

Rule files may be plain Prometheus rule files (`groups:`) or Kubernetes `PrometheusRule`
manifests (`spec.groups`), several YAML documents or a `kind: List` of them.
"""

from __future__ import annotations

import difflib
import re
import urllib.error
import urllib.request
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from agent.errors import InputError

#: Series every Prometheus server synthesises itself (never in a target's exposition).
PROMETHEUS_SYNTHETIC: frozenset[str] = frozenset({
    "up", "scrape_duration_seconds", "scrape_samples_scraped", "scrape_series_added",
    "scrape_samples_post_metric_relabeling", "ALERTS", "ALERTS_FOR_STATE",
})

#: Suffixes a rule author commonly forgets or adds by mistake.
_SUFFIXES: tuple[str, ...] = (
    "_total", "_seconds", "_seconds_total", "_bytes", "_bytes_total", "_info",
    "_bucket", "_count", "_sum",
)

#: PromQL words that look like identifiers but are not metric names.
_KEYWORDS: frozenset[str] = frozenset({
    "and", "or", "unless", "by", "without", "on", "ignoring", "group_left", "group_right",
    "bool", "offset", "atan2", "inf", "nan",
})
#: Aggregation operators: `sum by (x) (...)` puts a keyword, not `(`, after the name.
_AGGREGATIONS: frozenset[str] = frozenset({
    "sum", "min", "max", "avg", "group", "stddev", "stdvar", "count", "count_values",
    "bottomk", "topk", "quantile", "limitk", "limit_ratio",
})
#: Keywords followed by a parenthesised list of label names.
_LABEL_LIST_KEYWORDS: frozenset[str] = frozenset({
    "by", "without", "on", "ignoring", "group_left", "group_right",
})

_TOKEN = re.compile(
    r"""
    (?P<string>"(?:\\.|[^"\\])*"|'(?:\\.|[^'\\])*'|`[^`]*`)
  | (?P<comment>\#[^\n]*)
  | (?P<number>(?:\d|\.\d)[\w.]*(?:[eE][+-]?\d+)?)
  | (?P<ident>[A-Za-z_:][\w:]*)
  | (?P<op>=~|!~|!=|==|>=|<=|[-+*/%^(){}\[\],=<>@!~])
  | (?P<space>\s+)
  | (?P<other>.)
    """,
    re.VERBOSE,
)


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression reads.

    Handles names with `:` (recording-rule and vLLM style), `{__name__="x"}` selectors, and
    skips function and aggregation names, grouping label lists (`by (...)`, `on (...)`,
    `group_left (...)`, ...), label matchers, durations, numbers and strings.

    Args:
        expr: a PromQL expression.

    Returns:
        The set of metric names (regex `__name__` matchers cannot be resolved and are skipped).
    """
    toks = [(m.lastgroup, m.group()) for m in _TOKEN.finditer(expr)
            if m.lastgroup not in ("space", "comment")]
    names: set[str] = set()
    brace = bracket = 0
    i = 0
    while i < len(toks):
        kind, text = toks[i]
        nxt = toks[i + 1] if i + 1 < len(toks) else (None, "")
        if kind == "op":
            if text == "{":
                brace += 1
            elif text == "}":
                brace = max(brace - 1, 0)
            elif text == "[":
                bracket += 1
            elif text == "]":
                bracket = max(bracket - 1, 0)
        elif kind == "ident" and bracket == 0:
            if brace:
                # Inside a selector only `__name__="x"` names a metric; other idents are labels.
                if (text == "__name__" and nxt[1] == "=" and i + 2 < len(toks)
                        and toks[i + 2][0] == "string"):
                    names.add(_unquote(toks[i + 2][1]))
            elif text.lower() in _KEYWORDS:
                if text in _LABEL_LIST_KEYWORDS and nxt[1] == "(":
                    i = _skip_parens(toks, i + 1)
                    continue
            elif nxt[1] == "(" or (text in _AGGREGATIONS and nxt[1] in ("by", "without")):
                pass  # a function call or an aggregation
            else:
                names.add(text)
        i += 1
    return names


def _skip_parens(toks: list[tuple[str | None, str]], i: int) -> int:
    """Index just past the parenthesised group that starts at `toks[i]` (a `(`)."""
    depth = 0
    while i < len(toks):
        if toks[i][1] == "(":
            depth += 1
        elif toks[i][1] == ")":
            depth -= 1
            if depth == 0:
                return i + 1
        i += 1
    return i


def _unquote(s: str) -> str:
    body = s[1:-1]
    return body if s[0] == "`" else re.sub(r"\\(.)", r"\1", body)


# ------------------------------------------------------------------------------------ rules


@dataclass(slots=True, frozen=True)
class Rule:
    """One recording or alerting rule read from a file."""

    group: str
    name: str  # the alert name or the recorded series
    kind: str  # "alert" or "record"
    expr: str


def load_rules(path: str | Path) -> list[Rule]:
    """Every rule of a Prometheus rule file or PrometheusRule manifest.

    Args:
        path: a YAML file: `groups:` at the top, or `kind: PrometheusRule` with `spec.groups`;
            multi-document files and `kind: List` manifests are read document by document.

    Returns:
        The rules in file order. Raises `InputError` naming the file and field at fault.
    """
    import yaml

    p = Path(path)
    try:
        docs = list(yaml.safe_load_all(p.read_text()))
    except FileNotFoundError:
        raise InputError(f"{p}: no such rules file") from None
    except (yaml.YAMLError, UnicodeDecodeError) as exc:
        raise InputError(f"{p}: not valid YAML ({exc})") from None
    rules: list[Rule] = []
    found_groups = False
    for doc in _documents(docs):
        groups = _groups_of(doc, p)
        if groups is None:
            continue
        found_groups = True
        for gi, g in enumerate(groups):
            if not isinstance(g, dict) or not isinstance(g.get("rules", []), list):
                raise InputError(f"{p}: groups[{gi}] must be a mapping with a 'rules' list")
            gname = str(g.get("name", f"groups[{gi}]"))
            for ri, r in enumerate(g.get("rules") or []):
                where = f"{p}: group {gname!r} rules[{ri}]"
                if not isinstance(r, dict) or "expr" not in r:
                    raise InputError(f"{where}: missing 'expr'")
                if "alert" in r:
                    rules.append(Rule(gname, str(r["alert"]), "alert", str(r["expr"])))
                elif "record" in r:
                    rules.append(Rule(gname, str(r["record"]), "record", str(r["expr"])))
                else:
                    raise InputError(f"{where}: neither 'alert' nor 'record'")
    if not found_groups:
        raise InputError(f"{p}: no rule groups (expected 'groups:' or a PrometheusRule with "
                         "'spec.groups')")
    return rules


def _documents(docs: Iterable[Any]) -> Iterator[Any]:
    for doc in docs:
        if isinstance(doc, dict) and doc.get("kind") == "List":
            yield from _documents(doc.get("items") or [])
        elif doc is not None:
            yield doc


def _groups_of(doc: Any, p: Path) -> list[Any] | None:
    if not isinstance(doc, dict):
        raise InputError(f"{p}: expected a mapping at the top of each YAML document")
    if doc.get("kind") == "PrometheusRule":
        spec = doc.get("spec")
        if not isinstance(spec, dict) or not isinstance(spec.get("groups"), list):
            raise InputError(f"{p}: PrometheusRule without a 'spec.groups' list")
        return spec["groups"]
    if "groups" in doc:
        if not isinstance(doc["groups"], list):
            raise InputError(f"{p}: 'groups' must be a list")
        return doc["groups"]
    return None


# ------------------------------------------------------------------------------- exposition


def exposed_series(text: str, source: str = "exposition") -> set[str]:
    """Series names a Prometheus text (or OpenMetrics) exposition offers to queries.

    Includes the names implied by declared families even when they have no samples yet
    (a histogram without observations still gets `_bucket`, `_sum` and `_count` series).

    Args:
        text: the exposition.
        source: where it came from, for error messages.
    """
    if text.rstrip().endswith("# EOF"):
        from prometheus_client.openmetrics.parser import text_string_to_metric_families
    else:
        from prometheus_client.parser import text_string_to_metric_families

    names: set[str] = set()
    try:
        for fam in text_string_to_metric_families(text):
            names.update(s.name for s in fam.samples)
            names.update(_implied(fam.name, fam.type))
    except (ValueError, TypeError, IndexError) as exc:
        raise InputError(f"{source}: not a Prometheus text exposition ({exc})") from None
    return names


def _implied(family: str, mtype: str) -> tuple[str, ...]:
    if mtype == "counter":
        base = family[: -len("_total")] if family.endswith("_total") else family
        return (f"{base}_total", f"{base}_created")
    if mtype in ("histogram", "gaugehistogram"):
        return (f"{family}_bucket", f"{family}_sum", f"{family}_count", f"{family}_created")
    if mtype == "summary":
        return (family, f"{family}_sum", f"{family}_count", f"{family}_created")
    if mtype == "info":
        return (family if family.endswith("_info") else f"{family}_info",)
    return (family,)


def read_metrics(target: str, *, timeout_s: float = 10.0) -> tuple[set[str], str]:
    """The series names of `target`: an http(s) URL to scrape or a file of exposition text.

    Returns:
        (series names, a short description of the source). Raises `InputError` on failure.
    """
    if target.startswith(("http://", "https://")):
        req = urllib.request.Request(
            target, headers={"Accept": "text/plain;version=0.0.4;q=1,*/*;q=0.1"})
        try:
            with urllib.request.urlopen(req, timeout=timeout_s) as resp:
                text = resp.read().decode("utf-8", errors="replace")
        except (urllib.error.URLError, OSError, ValueError) as exc:
            raise InputError(f"{target}: cannot scrape ({exc})") from None
    else:
        p = Path(target)
        if not p.is_file():
            raise InputError(f"{target}: no such metrics file (or use an http:// URL)")
        text = p.read_text(errors="replace")
    return exposed_series(text, target), target


# ---------------------------------------------------------------------------------- checking


@dataclass(slots=True, frozen=True)
class Problem:
    """A rule that reads a metric the target does not expose."""

    rule: Rule
    metric: str
    suggestions: tuple[str, ...]

    def message(self, target: str) -> str:
        hint = ""
        if self.suggestions:
            hint = "; did you mean " + " or ".join(f"'{s}'" for s in self.suggestions) + "?"
        return (f"{self.rule.group}/{self.rule.name}: '{self.metric}' is not exposed by "
                f"{target}{hint}")


def suggest(name: str, available: set[str], n: int = 3) -> tuple[str, ...]:
    """Likely intended names for `name`: a suffix added or dropped first, then close spellings.

    Args:
        name: the metric name the rule queries.
        available: the names the target exposes.
        n: at most this many suggestions.
    """
    out: list[str] = []
    for suf in _SUFFIXES:
        if f"{name}{suf}" in available:
            out.append(f"{name}{suf}")
        if name.endswith(suf) and name[: -len(suf)] in available:
            out.append(name[: -len(suf)])
    # `_created` series are exposition bookkeeping, almost never what a rule meant to read.
    pool = sorted(a for a in available if not a.endswith("_created") or name.endswith("_created"))
    for cand in difflib.get_close_matches(name, pool, n=n, cutoff=0.8):
        if cand not in out:
            out.append(cand)
    return tuple(out[:n])


def check_rules(rules: list[Rule], available: set[str]) -> list[Problem]:
    """Rules that query a metric missing from `available`.

    Series recorded by rules of the same file and Prometheus' synthetic series (`up`,
    `ALERTS`, ...) count as available.

    Returns:
        One problem per (rule, missing metric), in rule order.
    """
    recorded = {r.name for r in rules if r.kind == "record"}
    known = available | recorded | PROMETHEUS_SYNTHETIC
    problems: list[Problem] = []
    for r in rules:
        for metric in sorted(metric_names(r.expr) - known):
            problems.append(Problem(r, metric, suggest(metric, available)))
    return problems
