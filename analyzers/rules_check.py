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
                    kind, name = "alert", str(r["alert"])
                elif "record" in r:
                    kind, name = "record", str(r["record"])
                else:
                    raise InputError(f"{where}: neither 'alert' nor 'record'")
                expr = r["expr"]
                if not isinstance(expr, str):
                    # YAML reads `expr: 5` as a number and `expr: [a]` as a list: a rule file
                    # holds PromQL as text, so a number is a mistake (quote it if meant).
                    raise InputError(f"{p}: group {gname!r} rule {name!r}: expr: expected a "
                                     f"PromQL string, got {type(expr).__name__} {expr!r}")
                rules.append(Rule(gname, name, kind, expr))
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



# ----------------------------------------------------------------------------------- syntax

#: PromQL binary operators (keywords compared lower-case); `@` takes a time on its right.
_BINARY_OPS: frozenset[str] = frozenset({
    "+", "-", "*", "/", "%", "^", "==", "!=", ">", "<", ">=", "<=", "and", "or", "unless",
    "atan2", "@",
})
_COMPARISONS: frozenset[str] = frozenset({"==", "!=", ">", "<", ">=", "<="})
_MATCH_OPS: frozenset[str] = frozenset({"=", "!=", "=~", "!~"})
_CLOSERS = {")": "(", "]": "[", "}": "{"}
#: Keywords that must be followed by a parenthesised label list (group_left/right may not).
_NEEDS_LABELS: frozenset[str] = frozenset({"by", "without", "on", "ignoring"})
_DURATION = r"(?:\d+(?:\.\d+)?(?:ms|s|m|h|d|w|y))+|\d+(?:\.\d+)?"
_RANGE_RE = re.compile(rf"^\s*(?:{_DURATION})\s*(?::\s*(?:{_DURATION})?\s*)?$")
_NUMBER_WORDS = frozenset({"inf", "nan"})

_Tok = tuple[str, str, int]  # (kind, text, 1-based column)


def _word(t: _Tok | None) -> str:
    return t[1].lower() if t is not None and t[0] == "ident" else ""


def _is_operand_end(t: _Tok | None, after_labels: bool) -> bool:
    """Whether `t` ends an operand: a name, number or string, or a closing bracket (not that
    of a label list leading an operand: `sum by (l) (x)`, `on (l)`)."""
    if t is None:
        return False
    kind, text, _ = t
    if kind in ("number", "string"):
        return True
    if kind == "ident":
        return text.lower() in _NUMBER_WORDS or text.lower() not in _KEYWORDS
    return text in _CLOSERS and not after_labels


def _closing(toks: list[_Tok], i: int, closer: str) -> int | None:
    """Index of the first `closer` after `toks[i]` (None when the expression ends first)."""
    for j in range(i + 1, len(toks)):
        if toks[j][1] == closer:
            return j
    return None


def _matchers_error(toks: list[_Tok], i: int, j: int) -> str | None:
    """What is wrong with the label matchers `toks[i + 1:j]` of a `{...}` at `toks[i]`."""
    items: list[list[_Tok]] = [[]]
    for t in toks[i + 1:j]:
        if t[1] == "," or _word(t) == "or":
            items.append([])
        else:
            items[-1].append(t)
    if not items[-1] and len(items) > 1:
        items.pop()  # a trailing comma
    for item in items:
        if not item:
            if len(items) > 1:
                return f"empty label matcher in the selector at column {toks[i][2]}"
            continue
        if len(item) == 1 and item[0][0] == "string":
            continue  # {"metric_name"}
        if (len(item) != 3 or item[0][0] not in ("ident", "string") or item[1][1] not in
                _MATCH_OPS or item[2][0] != "string"):
            shown = " ".join(t[1] for t in item)
            return (f"label matcher {shown!r} at column {item[0][2]}: expected label=\"value\" "
                    "(or !=, =~, !~ and a quoted value)")
    return None


def promql_syntax_error(expr: str) -> str | None:
    """A basic syntax check of a PromQL expression, for when `promtool` is not installed (it
    lacks what needs the full grammar, such as unknown function names and argument types).

    Checks: a non-empty expression; strings closed; only PromQL's characters and operators;
    (), [] and {} balanced and properly nested; label matchers reading ``label op "value"``;
    `=`, `=~` and `!~` only in them; a range or subquery inside [], after a selector or a
    subexpression; every binary operator between two operands (`+` and `-` may be unary);
    no two operands without an operator between them; `by`, `without`, `on` and `ignoring`
    followed by a list of labels; `bool` after a comparison.

    Returns:
        The first problem found, naming its column (1-based), or None.
    """
    toks: list[_Tok] = [(m.lastgroup or "", m.group(), m.start() + 1)
                        for m in _TOKEN.finditer(expr)
                        if m.lastgroup not in ("space", "comment")]
    if not toks:
        return "empty expression"
    parens: list[int] = []  # columns of the open (
    prev: _Tok | None = None  # the last significant token (a bracketed group: its closer)
    after_labels = False  # `prev` closed a label list that leads an operand
    i = 0
    while i < len(toks):
        t = toks[i]
        kind, text, col = t
        low = text.lower()
        ends = _is_operand_end(prev, after_labels)
        if kind == "other":
            if text in "\"'`":
                return f"unterminated string starting at column {col}"
            return f"unexpected character {text!r} at column {col}"
        if text in ("{", "["):
            closer = "}" if text == "{" else "]"
            j = _closing(toks, i, closer)
            if j is None:
                return f"unclosed {text!r} opened at column {col}"
            inner = toks[i + 1:j]
            nested = next((x for x in inner if x[1] in "{}[]()"), None)
            if nested is not None:
                return f"unexpected {nested[1]!r} at column {nested[2]} inside {text}...{closer}"
            if text == "{":
                if ends and not (prev is not None and prev[0] == "ident"
                                 and low not in _KEYWORDS):
                    return f"missing operator before the selector at column {col}"
                err = _matchers_error(toks, i, j)
            else:
                if not ends or (prev is not None and (prev[0] in ("number", "string")
                                                      or prev[1] == "]")):
                    return (f"'[' at column {col} must follow a selector or a "
                            "parenthesised subexpression (not a number, string or range)")
                body = expr[col:toks[j][2] - 1]
                err = None if _RANGE_RE.match(body) else (
                    f"[{body}] at column {col}: expected a range such as [5m] or a subquery "
                    "such as [1h:5m]")
            if err is not None:
                return err
            prev, after_labels, i = toks[j], False, j + 1
            continue
        if text in ("}", "]"):
            return f"unexpected {text!r} at column {col}"
        if text == "(":
            if _word(prev) in _LABEL_LIST_KEYWORDS:
                j = _closing(toks, i, ")")
                if j is None:
                    return f"unclosed '(' opened at column {col}"
                for x in toks[i + 1:j]:
                    if x[1] != "," and x[0] not in ("ident", "string"):
                        return (f"unexpected {x[1]!r} at column {x[2]} in the label list of "
                                f"{toks[i - 1][1]!r}")
                # `sum(x) by (l)` ends an operand; `sum by (l) (x)` and `on (l)` lead one.
                trailing = _word(prev) in ("by", "without") and i >= 2 and toks[i - 2][1] == ")"
                prev, after_labels, i = toks[j], not trailing, j + 1
                continue
            call = prev is not None and prev[0] == "ident" and _word(prev) not in _KEYWORDS
            if ends and not call:
                return f"missing operator before '(' at column {col}"
            parens.append(col)
            prev, after_labels = t, False
            i += 1
            continue
        if text == ")":
            if not parens:
                return f"unexpected ')' at column {col}"
            opened = parens.pop()
            if prev is not None and prev[0] == "op" and prev[1] in _BINARY_OPS | {","}:
                return f"{prev[1]!r} at column {prev[2]} has nothing after it"
            if prev is not None and prev[1] == "(" and not (
                    i >= 2 and toks[i - 2][0] == "ident"):
                return f"empty parentheses at column {opened}"
            prev, after_labels = t, False
            i += 1
            continue
        if text == ",":
            if not parens:
                return f"',' at column {col} outside a function's arguments"
            if not ends:
                return f"',' at column {col} has no argument before it"
            prev, after_labels = t, False
            i += 1
            continue
        if kind == "op" and text in ("=", "=~", "!~", "!", "~"):
            hint = " (did you mean '=='?)" if text == "=" else ""
            return f"{text!r} at column {col} outside a {{...}} label matcher{hint}"
        if low in _BINARY_OPS:
            if not ends and not (text in ("+", "-") and kind == "op"):
                return f"operator {text!r} at column {col} has no left operand"
            prev, after_labels = ("op", low, col), False
            i += 1
            continue
        if kind == "ident" and low in _KEYWORDS and low not in _NUMBER_WORDS:
            nxt = toks[i + 1][1] if i + 1 < len(toks) else ""
            if low in _NEEDS_LABELS and nxt != "(":
                return (f"{text!r} at column {col} must be followed by a parenthesised list "
                        "of labels")
            if low == "bool" and not (prev is not None and prev[1] in _COMPARISONS):
                return f"'bool' at column {col} must follow a comparison operator"
            if low == "offset" and not ends:
                return f"'offset' at column {col} must follow a selector"
            prev, after_labels = t, False
            i += 1
            continue
        # An operand: a name, a number or a string.
        if ends:
            return f"missing operator between {prev[1]!r} and {text!r} at column {col}"
        prev, after_labels = t, False
        i += 1
    if parens:
        return f"unclosed '(' opened at column {parens[-1]}"
    if prev is not None and prev[0] == "op" and prev[1] in _BINARY_OPS:
        return f"expression ends with operator {prev[1]!r} (column {prev[2]})"
    if _word(prev) in _KEYWORDS and _word(prev) not in _NUMBER_WORDS and not after_labels:
        return f"expression ends with {prev[1]!r} (column {prev[2]})"
    return None



@dataclass(slots=True, frozen=True)
class SyntaxProblem:
    """A rule whose expression does not parse (or that promtool otherwise refuses)."""

    rule: Rule | None  # None: a problem promtool names without a rule
    problem: str
    by: str  # "kvscope" (the basic check) or "promtool"

    def message(self, path: str | Path) -> str:
        where = (f"group {self.rule.group!r} rule {self.rule.name!r}: expr"
                 if self.rule is not None else "rules")
        tool = " (promtool check rules)" if self.by == "promtool" else ""
        return f"{path}: {where}: {self.problem}{tool}"


_PROMTOOL_LINE = re.compile(r'group "(?P<group>\d+)", rule (?P<rule>\d+), "[^"]*": (?P<msg>.*)$')


def promtool_problems(rules: list[Rule], promtool: str, *, timeout_s: float = 60.0
                      ) -> list[SyntaxProblem]:
    """What `promtool check rules` says about `rules` (PromQL parse errors, invalid recording
    rule names, ...), mapped back to the rules.

    The rules are written to a temporary plain rule file, one group per rule (groups named by
    index, so a PrometheusRule manifest, several documents or repeated group names check the
    same way); it is removed afterwards.

    Raises:
        InputError: promtool cannot be run, or fails without saying which rule.
    """
    import json
    import os
    import subprocess
    import tempfile

    doc = {"groups": [{"name": str(i), "rules": [{r.kind: r.name, "expr": r.expr}]}
                      for i, r in enumerate(rules)]}
    fd, tmp = tempfile.mkstemp(prefix="kvscope-rules-", suffix=".json")
    try:
        with os.fdopen(fd, "w") as fh:
            json.dump(doc, fh)  # JSON is YAML
        try:
            res = subprocess.run([promtool, "check", "rules", tmp], capture_output=True,
                                 text=True, timeout=timeout_s, check=False)
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise InputError(f"{promtool}: cannot run promtool check rules ({exc})") from None
    finally:
        os.unlink(tmp)
    if res.returncode == 0:
        return []
    out: list[SyntaxProblem] = []
    for line in (res.stdout + "\n" + res.stderr).splitlines():
        m = _PROMTOOL_LINE.search(line)
        if m is not None and int(m.group("group")) < len(rules):
            out.append(SyntaxProblem(rules[int(m.group("group"))], m.group("msg").strip(),
                                     "promtool"))
    if not out:
        said = " ".join((res.stderr or res.stdout).split()) or f"exit status {res.returncode}"
        out.append(SyntaxProblem(None, said.replace(tmp, "<rules>"), "promtool"))
    return out


def syntax_problems(rules: list[Rule], *, promtool: str | None = None) -> list[SyntaxProblem]:
    """Rules whose PromQL does not parse: the basic check (`promql_syntax_error`) first, then,
    when it finds nothing and `promtool` (a path) is given, `promtool check rules`."""
    out = [SyntaxProblem(r, err, "kvscope") for r in rules
           if (err := promql_syntax_error(r.expr)) is not None]
    if not out and promtool is not None and rules:
        out = promtool_problems(rules, promtool)
    return out


def check_syntax(path: str | Path, rules: list[Rule], *, promtool: str | None = None) -> None:
    """Refuse a rule file with a PromQL syntax error: InputError naming the file, the group,
    the rule and the problem (the first; the count of the others).

    Args:
        path: the rule file, for the message.
        rules: its rules (`load_rules`).
        promtool: the promtool binary, when installed (`shutil.which("promtool")`).
    """
    problems = syntax_problems(rules, promtool=promtool)
    if problems:
        more = (f" (and {len(problems) - 1} more rule(s) that do not parse)"
                if len(problems) > 1 else "")
        raise InputError(problems[0].message(path) + more)
