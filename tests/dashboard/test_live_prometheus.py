"""A real Prometheus server scrapes `kvscope run` and fires the remote-failure alert.

Everything binds 127.0.0.1. The remote tier is warmed by a fault-free run first; a second
fault-free run is scraped to show the alert stays quiet on a healthy remote, then a run with
`--fault remote-corrupt-rate=0.2` is scraped until KvscopeRemoteReadFailureRatioHigh fires.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.conftest import REPO, free_port, require_binary

RULES = REPO / "dashboard" / "rules" / "kvscope-rules.yaml"
ALERT = "KvscopeRemoteReadFailureRatioHigh"
MODEL = "kvscope/tiny"
#: The alert's `for:` in the test copy of the rules (production: 5m); long enough that the
#: pending state is seen by a 0.25 s poll, short enough for the test to finish in seconds.
TEST_FOR = "5s"
DEADLINE_S = 90.0


def _rules_with_short_for(dst: Path) -> None:
    """Copy the shipped rules, shortening only the remote-failure alert's `for:`.

    The expressions, thresholds and 5m rate windows are kept: rate() over a 5m range works on
    the few seconds of samples a test has, so only the hold time needs to change.
    """
    doc = yaml.safe_load(RULES.read_text())
    hits = [r for g in doc["groups"] for r in g["rules"] if r.get("alert") == ALERT]
    assert len(hits) == 1 and hits[0]["for"] == "5m"
    hits[0]["for"] = TEST_FOR
    dst.write_text(yaml.safe_dump(doc, sort_keys=False))


def _prometheus_config(path: Path, rules: Path, targets: list[str]) -> None:
    # scrape_timeout defaults to 10s, which Prometheus refuses above a 1s scrape_interval.
    cfg = {
        "global": {"scrape_interval": "1s", "scrape_timeout": "1s",
                   "evaluation_interval": "1s"},
        "rule_files": [str(rules)],
        "scrape_configs": [{"job_name": "kvscope", "static_configs": [{"targets": targets}]}],
    }
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))


def _api(base: str, path: str, **params: str) -> Any:
    url = f"{base}{path}"
    if params:
        url += "?" + urllib.parse.urlencode(params)
    with urllib.request.urlopen(url, timeout=5) as resp:
        body = json.load(resp)
    assert body["status"] == "success", body
    return body["data"]


def _query(base: str, expr: str) -> float | None:
    """The single value of an instant query, or None when it returns no series."""
    result = _api(base, "/api/v1/query", query=expr)["result"]
    assert len(result) <= 1, result
    return float(result[0]["value"][1]) if result else None


def _our_alerts(base: str) -> list[dict[str, Any]]:
    return [a for a in _api(base, "/api/v1/alerts")["alerts"]
            if a["labels"]["alertname"] == ALERT]


def _kvscope_run(tmp: Path, name: str, *args: str) -> subprocess.Popen[bytes]:
    log = (tmp / f"{name}.log").open("wb")
    return subprocess.Popen(
        [sys.executable, "-m", "kvscope.cli", "run", "--workload", "docqa", "--model", "tiny",
         "--remote", f"file://{tmp / 'remote'}", "--out", str(tmp / name), "--threads", "1",
         "--no-collectors", "-q", *args],
        cwd=REPO, stdout=log, stderr=subprocess.STDOUT)


def _stop(proc: subprocess.Popen[bytes] | None) -> None:
    if proc is not None and proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _start_prometheus(binary: str, config: Path, tsdb: Path, web_port: int,
                      log: Path) -> subprocess.Popen[bytes]:
    """A real Prometheus on 127.0.0.1:`web_port` with `config`, ready to query (stopped again
    if it never gets ready)."""
    proc = subprocess.Popen(
        [binary, f"--config.file={config}", f"--storage.tsdb.path={tsdb}",
         f"--web.listen-address=127.0.0.1:{web_port}", "--log.level=warn"],
        stdout=log.open("wb"), stderr=subprocess.STDOUT)
    try:
        _wait_ready(f"http://127.0.0.1:{web_port}", proc, log)
    except BaseException:
        _stop(proc)
        raise
    return proc


def _wait_ready(base: str, proc: subprocess.Popen[bytes], log: Path) -> None:
    end = time.monotonic() + 30
    while time.monotonic() < end:
        assert proc.poll() is None, f"prometheus exited:\n{log.read_text()[-3000:]}"
        try:
            with urllib.request.urlopen(f"{base}/-/ready", timeout=2) as resp:
                if resp.status == 200:
                    return
        except (urllib.error.URLError, ConnectionError):
            pass
        time.sleep(0.2)
    pytest.fail(f"prometheus not ready after 30 s:\n{log.read_text()[-3000:]}")


@pytest.mark.slow
@pytest.mark.service
def test_remote_failure_alert_fires_on_a_live_run(tmp_path: Path) -> None:
    binary = require_binary("prometheus")
    rules = tmp_path / "rules.yaml"
    _rules_with_short_for(rules)
    healthy_port, faulty_port, web_port = free_port(), free_port(), free_port()
    config = tmp_path / "prometheus.yml"
    _prometheus_config(config, rules,
                       [f"127.0.0.1:{healthy_port}", f"127.0.0.1:{faulty_port}"])
    base = f"http://127.0.0.1:{web_port}"
    prom_log = tmp_path / "prometheus.log"

    # Warm the remote tier; nothing scrapes this one (it finishes in about two seconds).
    warm = subprocess.run(
        [sys.executable, "-m", "kvscope.cli", "run", "--workload", "docqa", "--model", "tiny",
         "-n", "30", "--rate", "0", "--remote", f"file://{tmp_path / 'remote'}",
         "--out", str(tmp_path / "warm"), "--metrics-port", "0", "--threads", "1",
         "--no-collectors", "-q"],
        cwd=REPO, capture_output=True, text=True, timeout=120, check=False)
    assert warm.returncode == 0, warm.stdout + warm.stderr

    prom = healthy = faulty = None
    started = time.monotonic()
    try:
        prom = _start_prometheus(binary, config, tmp_path / "tsdb", web_port, prom_log)

        # A small device pool evicts documents, so later requests keep hitting the remote.
        pool = ("--num-blocks", "64", "--rate", "3")
        healthy = _kvscope_run(tmp_path, "healthy", "-n", "60", *pool,
                               "--metrics-port", str(healthy_port))
        hit_rate = None
        while time.monotonic() - started < DEADLINE_S and healthy.poll() is None:
            hit_rate = _query(base, "instance_job_model:kvscope_remote_hit_tokens:rate5m"
                                    f'{{model="{MODEL}"}}')
            if hit_rate:
                break
            time.sleep(0.25)
        assert hit_rate and hit_rate > 0, (
            f"no remote hits recorded from the healthy run:\n"
            f"{(tmp_path / 'healthy.log').read_text()[-2000:]}")
        assert _query(base, "instance_job_model:kvscope_remote_load_failed_tokens:rate5m") == 0.0
        assert _our_alerts(base) == []
        _stop(healthy)

        # Corrupted objects fail their checksum after the lookup promised them, so every one
        # counts in the alert's ratio. remote-error-rate=0.5 is a weaker trigger: a retry
        # absorbs most errors and a failed lookup promises nothing, so in a trial of this
        # workload only 704 of 36,720 promised remote tokens failed (1.9 %, under the 5 %).
        faulty = _kvscope_run(tmp_path, "faulty", "-n", "200", *pool,
                              "--fault", "remote-corrupt-rate=0.2",
                              "--metrics-port", str(faulty_port))
        states: list[str] = []
        alerts: list[dict[str, Any]] = []
        while time.monotonic() - started < DEADLINE_S and faulty.poll() is None:
            alerts = _our_alerts(base)
            for a in alerts:  # the state sequence, without repeats
                if not states or states[-1] != a["state"]:
                    states.append(a["state"])
            if states and states[-1] == "firing":
                break
            time.sleep(0.25)
        assert states[-1:] == ["firing"], (
            f"alert not firing after {time.monotonic() - started:.0f} s; states {states}; "
            f"last /api/v1/alerts answer: {alerts}; faulty run exit {faulty.poll()}:\n"
            f"{(tmp_path / 'faulty.log').read_text()[-2000:]}")
        assert states == ["pending", "firing"]  # held for `for:` before firing
        (alert,) = alerts
        # Alerts are per engine: the instance and job of the faulty run ride along.
        assert alert["labels"] == {"alertname": ALERT, "model": MODEL, "severity": "warning",
                                   "instance": f"127.0.0.1:{faulty_port}", "job": "kvscope"}
        ratio = float(alert["value"])
        assert 0.05 < ratio < 1.0
        assert alert["annotations"]["summary"] == (
            f"Remote KV reads failing for {MODEL} on 127.0.0.1:{faulty_port}")
        # The description's templated numerator and denominator read the recording rules back.
        failed = _query(base, "instance_job_model:kvscope_remote_load_failed_tokens:rate5m"
                              f'{{instance="127.0.0.1:{faulty_port}"}}')
        assert failed is not None and failed > 0
        assert "remote-hit tokens/s (" in alert["annotations"]["description"]

        # Every shipped rule evaluated against the real series without an error.
        groups = _api(base, "/api/v1/rules")["groups"]
        bad = [(r["name"], r.get("lastError")) for g in groups for r in g["rules"]
               if r["health"] == "err"]
        assert bad == []
        shipped = sum(len(g["rules"]) for g in yaml.safe_load(RULES.read_text())["groups"])
        assert sum(len(g["rules"]) for g in groups) == shipped
    finally:
        for proc in (faulty, healthy, prom):
            _stop(proc)
