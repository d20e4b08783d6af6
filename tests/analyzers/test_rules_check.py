"""The rule linter: PromQL name extraction, rule-file formats, expositions, CLI exit codes."""

from __future__ import annotations

import http.server
import json
import re
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from agent.errors import InputError
from agent.schema import METRICS, catalogued_series
from analyzers.rules_check import (
    Rule,
    check_rules,
    exposed_series,
    load_rules,
    metric_names,
    read_metrics,
    suggest,
)
from kvscope.cli import main
from tests.conftest import REPO, shared_data

KVSCOPE_RULES = REPO / "dashboard" / "rules" / "kvscope-rules.yaml"


def _histogram(name: str, help_: str) -> str:
    labels = 'model_name="Qwen/Qwen2.5-1.5B"'
    return (
        f"# HELP {name} {help_}\n# TYPE {name} histogram\n"
        f'{name}_bucket{{{labels},le="0.1"}} 3.0\n'
        f'{name}_bucket{{{labels},le="+Inf"}} 5.0\n'
        f"{name}_count{{{labels}}} 5.0\n{name}_sum{{{labels}}} 1.25\n"
    )


def _counter(name: str, help_: str, value: float) -> str:
    return (f"# HELP {name} {help_}\n# TYPE {name} counter\n"
            f'{name}_total{{model_name="Qwen/Qwen2.5-1.5B"}} {value}\n')


def _gauge(name: str, help_: str, value: float) -> str:
    return (f"# HELP {name} {help_}\n# TYPE {name} gauge\n"
            f'{name}{{model_name="Qwen/Qwen2.5-1.5B"}} {value}\n')


#: A vLLM v1 /metrics exposition built from the names in vLLM's vllm/v1/metrics/loggers.py:
#: counters carry `_total`, latencies are `_seconds` histograms.
VLLM_V1_EXPOSITION = "".join([
    _histogram("vllm:time_to_first_token_seconds", "Histogram of time to first token."),
    _histogram("vllm:request_queue_time_seconds", "Time in the WAITING phase."),
    _histogram("vllm:request_prefill_time_seconds", "Time in the PREFILL phase."),
    _histogram("vllm:request_decode_time_seconds", "Time in the DECODE phase."),
    _histogram("vllm:inter_token_latency_seconds", "Inter-token latency."),
    _histogram("vllm:e2e_request_latency_seconds", "End-to-end request latency."),
    _counter("vllm:prefix_cache_queries", "Prefix cache queries, in tokens.", 8192),
    _counter("vllm:prefix_cache_hits", "Prefix cache hits, in tokens.", 6144),
    _counter("vllm:num_preemptions", "Cumulative number of preemptions.", 2),
    _counter("vllm:prompt_tokens", "Prompt tokens processed.", 9000),
    _gauge("vllm:kv_cache_usage_perc", "KV-cache usage, 1 means 100 percent.", 0.42),
    _gauge("vllm:num_requests_waiting", "Requests waiting.", 3),
    _gauge("vllm:num_requests_running", "Requests running.", 7),
])


def _catalogue_exposition() -> str:
    """One sample of every catalogued series: what a kvscope engine plus agent expose."""
    out = []
    for m in METRICS:
        out.append(f"# TYPE {m.family} {m.type}")
        out += [f"{s} 1.0" for s in m.series_names if not s.endswith("_bucket")]
        if m.type == "histogram":
            out.append(f'{m.name}_bucket{{le="+Inf"}} 1.0')
    return "\n".join(out) + "\n"


# ------------------------------------------------------------------------ name extraction


@pytest.mark.parametrize(("expr", "names"), [
    ("rate(vllm:num_preemptions[5m]) > 1", {"vllm:num_preemptions"}),
    ('count(up{job="vllm"} == 1) < 40', {"up"}),
    ("sum by (le, model_name) (rate(a:b_bucket[5m] offset 1h))", {"a:b_bucket"}),
    ("sum(rate(x_total[5m])) without (pod) / ignoring (le) y", {"x_total", "y"}),
    ("x * on (model) group_left (tier, reason) y", {"x", "y"}),
    ("a and b or c unless d", {"a", "b", "c", "d"}),
    ('{__name__="from_name", job="j"} > bool 3', {"from_name"}),
    ('{__name__=~"regex.*"}', set()),
    ("max_over_time(q[1h30m:5m] @ start()) > 1e3 + 0x1f + Inf - NaN", {"q"}),
    ('histogram_quantile(0.99, sum(rate(h_bucket{le="2.0", by="on"}[5m])) by (le))',
     {"h_bucket"}),
    ("topk by (model) (3, z) # by q", {"z"}),
    ('label_replace(m, "dst", "$1", "src", "(sum|by)")', {"m"}),
    ("sum(sum_total)", {"sum_total"}),
])
def test_metric_names(expr: str, names: set[str]) -> None:
    assert metric_names(expr) == names


# ------------------------------------------------------------------------ rule files


def test_prometheusrule_manifest_is_read() -> None:
    rules = load_rules(shared_data("alerts/vllm-prometheusrule.yaml"))
    assert [r.name for r in rules] == [
        "VllmE2ELatencyP99TooHigh", "VllmTTFTP99TooHigh", "VllmITLP99TooHigh",
        "VllmSlowRequestsPresent", "VllmKVCacheNearFull", "VllmHighQueueDepth",
        "VllmPreemptionSpike", "VllmReplicaDown",
    ]
    assert {r.group for r in rules} == {"vllm-latency-slo", "vllm-fleet-health"}
    assert all(r.kind == "alert" for r in rules)


def test_plain_rule_file_and_list_manifest(tmp_path: Path) -> None:
    plain = tmp_path / "plain.yaml"
    plain.write_text("groups:\n- name: g\n  rules:\n  - record: job:x:rate5m\n"
                     "    expr: rate(x_total[5m])\n  - alert: A\n    expr: job:x:rate5m > 1\n")
    assert load_rules(plain) == [Rule("g", "job:x:rate5m", "record", "rate(x_total[5m])"),
                                 Rule("g", "A", "alert", "job:x:rate5m > 1")]
    listed = tmp_path / "list.yaml"
    listed.write_text(
        "kind: List\nitems:\n- kind: PrometheusRule\n  spec:\n    groups:\n    - name: a\n"
        "      rules:\n      - alert: B\n        expr: y > 0\n---\n"
        "apiVersion: monitoring.coreos.com/v1\nkind: PrometheusRule\nspec:\n  groups:\n"
        "  - name: b\n    rules:\n    - alert: C\n      expr: z > 0\n")
    assert [(r.group, r.name) for r in load_rules(listed)] == [("a", "B"), ("b", "C")]


@pytest.mark.parametrize(("text", "message"), [
    ("groups: [\n", "not valid YAML"),
    ("kind: Deployment\nspec: {}\n", "no rule groups"),
    ("kind: PrometheusRule\nspec: {}\n", "spec.groups"),
    ("groups:\n- name: g\n  rules:\n  - alert: A\n", "group 'g' rules[0]: missing 'expr'"),
    ("groups:\n- name: g\n  rules:\n  - expr: x\n", "neither 'alert' nor 'record'"),
])
def test_bad_rule_files_name_the_problem(tmp_path: Path, text: str, message: str) -> None:
    p = tmp_path / "bad.yaml"
    p.write_text(text)
    with pytest.raises(InputError, match=re.escape(message)) as exc:
        load_rules(p)
    assert str(p) in str(exc.value)


# ------------------------------------------------------------------------ expositions


def test_exposed_series_include_declared_families() -> None:
    text = ("# TYPE empty_seconds histogram\n# TYPE c_total counter\nc_total 3\n"
            "# TYPE g gauge\ng 1\n")
    assert exposed_series(text) == {
        "empty_seconds_bucket", "empty_seconds_sum", "empty_seconds_count",
        "empty_seconds_created", "c_total", "c_created", "g",
    }


def test_exposed_series_reads_openmetrics() -> None:
    text = "# TYPE c counter\nc_total 1.0\n# EOF\n"
    assert exposed_series(text) == {"c_total", "c_created"}


def test_bad_exposition_is_input_error(tmp_path: Path) -> None:
    p = tmp_path / "bad.prom"
    p.write_text("this is { not an exposition\n")
    with pytest.raises(InputError, match=r"bad\.prom"):
        read_metrics(str(p))
    with pytest.raises(InputError, match="no such metrics file"):
        read_metrics(str(tmp_path / "missing.prom"))


def test_suggestions() -> None:
    available = {"vllm:num_preemptions_total", "vllm:num_preemptions_created",
                 "ttft_seconds_bucket", "queue_depth"}
    assert suggest("vllm:num_preemptions", available) == ("vllm:num_preemptions_total",)
    assert suggest("queue_depth_total", available) == ("queue_depth",)
    assert suggest("ttft_bucket", available) == ()
    assert suggest("queue_dept", available) == ("queue_depth",)


# ------------------------------------------------------------------------ checking


def test_vllm_example_rules_against_v1_exposition() -> None:
    rules = load_rules(shared_data("alerts/vllm-prometheusrule.yaml"))
    problems = check_rules(rules, exposed_series(VLLM_V1_EXPOSITION))
    assert [(p.rule.name, p.metric, p.suggestions) for p in problems] == [
        ("VllmPreemptionSpike", "vllm:num_preemptions", ("vllm:num_preemptions_total",)),
    ]
    assert problems[0].message("v1.prom") == (
        "vllm-fleet-health/VllmPreemptionSpike: 'vllm:num_preemptions' is not exposed by "
        "v1.prom; did you mean 'vllm:num_preemptions_total'?")


def test_kvscope_rules_are_clean_against_the_catalogue() -> None:
    available = exposed_series(_catalogue_exposition())
    # The catalogue lists every series the exposition has, `_created` ones included.
    assert catalogued_series() == available
    assert check_rules(load_rules(KVSCOPE_RULES), available) == []


def test_recorded_series_count_as_available() -> None:
    rules = [Rule("g", "job:x:rate5m", "record", "rate(x_total[5m])"),
             Rule("g", "A", "alert", "job:x:rate5m > 1 and on() up == 1")]
    assert check_rules(rules, {"x_total"}) == []
    assert [p.metric for p in check_rules(rules, set())] == ["x_total"]


# ------------------------------------------------------------------------ CLI


def test_cli_flags_vllm_rule_and_exits_1(tmp_path: Path, capsys: pytest.CaptureFixture[str]
                                         ) -> None:
    prom = tmp_path / "v1.prom"
    prom.write_text(VLLM_V1_EXPOSITION)
    rules = shared_data("alerts/vllm-prometheusrule.yaml")
    assert main(["rules", "check", str(rules), "--metrics", str(prom)]) == 1
    out = capsys.readouterr().out.splitlines()
    assert out == [
        f"vllm-fleet-health/VllmPreemptionSpike: 'vllm:num_preemptions' is not exposed by "
        f"{prom}; did you mean 'vllm:num_preemptions_total'?",
        "8 rule(s) checked, 8 metric name(s) queried, 1 problem(s)",
    ]
    assert main(["rules", "check", str(rules), "--metrics", str(prom), "--json"]) == 1
    report = json.loads(capsys.readouterr().out)
    assert report["problems"] == [{
        "group": "vllm-fleet-health", "rule": "VllmPreemptionSpike", "kind": "alert",
        "metric": "vllm:num_preemptions", "suggestions": ["vllm:num_preemptions_total"],
    }]


def test_cli_bad_input_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    prom = tmp_path / "v1.prom"
    prom.write_text(VLLM_V1_EXPOSITION)
    assert main(["rules", "check", str(tmp_path / "none.yaml"), "--metrics", str(prom)]) == 2
    assert "none.yaml: no such rules file" in capsys.readouterr().err


@pytest.fixture
def metrics_server() -> Iterator[str]:
    body = _catalogue_exposition().encode()

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            code = 200 if self.path == "/metrics" else 404
            self.send_response(code)
            self.send_header("Content-Type", "text/plain; version=0.0.4")
            self.end_headers()
            if code == 200:
                self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def test_cli_scrapes_url(metrics_server: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["rules", "check", str(KVSCOPE_RULES), "--metrics",
                 f"{metrics_server}/metrics"]) == 0
    assert capsys.readouterr().out.endswith(" 0 problem(s)\n")
    assert main(["rules", "check", str(KVSCOPE_RULES), "--metrics",
                 f"{metrics_server}/nothing"]) == 2
    assert "cannot scrape" in capsys.readouterr().err
