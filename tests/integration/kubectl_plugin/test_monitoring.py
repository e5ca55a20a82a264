"""The alert rules and the Grafana dashboard in deploy/monitoring: every metric they name is one our services
really export (checked against live /metrics scrapes of the node agent, verifier and webhook), promtool accepts
the rules and their unit tests fire each alert, and the Helm chart ships the same files."""

from __future__ import annotations

import json
import re
import ssl
import subprocess
from pathlib import Path

import aiohttp
import pytest
import trustme
import yaml

from kai_isolator.services.admission.server import AdmissionServer
from kai_isolator.services.admission.settings import AdmissionSettings
from kai_isolator.services.devcluster.build import promtool
from kai_isolator.services.verifier.command import running
from kai_isolator.services.verifier.settings import VerifierSettings
from kai_isolator.shared.settings import BusSettings

REPO = Path(__file__).resolve().parents[3]
MONITORING = REPO / "deploy" / "monitoring"
CHART_FILES = REPO / "deploy" / "helm" / "kai-resource-isolator" / "files"
# Series Prometheus itself makes for every target, not any service.
PROMETHEUS_OWN = {"up"}
_NAME = re.compile(r"\b(kai_isolator_[a-z0-9_]+|hami_[a-z0-9_]+|up)\b(?!\s*\()")


def named_metrics(expr: str) -> set[str]:
    """Metric names an expression reads (ours are prefixed, so label names and functions never match)."""
    without_strings = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)
    without_matchers = re.sub(r"\{[^}]*\}", "{}", without_strings)
    return set(_NAME.findall(without_matchers))


def rule_exprs() -> dict[str, str]:
    groups = yaml.safe_load((MONITORING / "prometheus-rules.yaml").read_text())["groups"]
    return {rule["alert"]: rule["expr"] for group in groups for rule in group["rules"]}


def dashboard_exprs() -> dict[str, str]:
    dashboard = json.loads((MONITORING / "grafana-dashboard.json").read_text())
    found = {f"{p['title']}/{t['refId']}": t["expr"] for p in dashboard["panels"] for t in p["targets"]}
    for variable in dashboard["templating"]["list"]:
        if variable["type"] == "query":
            found[f"${variable['name']}"] = variable["query"]["query"]
    return found


async def scrape(url: str, session: aiohttp.ClientSession) -> set[str]:
    """Every series name a /metrics page can carry: counters' _total, histograms' _bucket/_sum/_count, gauges as they are."""
    async with session.get(url) as response:
        assert response.status == 200
        text = await response.text()
    names: set[str] = set()
    for family, kind in re.findall(r"^# TYPE (\S+) (\S+)$", text, re.MULTILINE):
        if kind == "counter":
            family = family.removesuffix("_total")  # the text format may name a counter's family with or without it
        suffixes = {"counter": ("_total", "_created"), "histogram": ("_bucket", "_sum", "_count", "_created"),
                    "summary": ("_sum", "_count", "_created", "")}.get(kind, ("",))
        names.update(family + suffix for suffix in suffixes)
    return names


def test_the_name_check_catches_a_misspelt_metric() -> None:
    assert named_metrics('sum by (reason) (increase(kai_isolator_verdict_total{verdict="missing"}[5m]))') == {"kai_isolator_verdict_total"}
    assert named_metrics('up{job=~".*nodeagent.*"} == 0 or hami_vgpu_memory_used_bytes{namespace=~"$namespace"}') == {"up", "hami_vgpu_memory_used_bytes"}


async def test_every_metric_a_rule_or_panel_names_is_exported(start_agent, bus_settings: BusSettings, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    exported: set[str] = set(PROMETHEUS_OWN)
    ca = trustme.CA()
    cert = ca.issue_cert("127.0.0.1")
    cert.cert_chain_pems[0].write_to_path(str(tmp_path / "tls.crt"))
    cert.private_key_pem.write_to_path(str(tmp_path / "tls.key"))
    webhook = AdmissionServer(AdmissionSettings(listen="127.0.0.1:0", tls_cert_file=tmp_path / "tls.crt", tls_private_key_file=tmp_path / "tls.key"), None)
    await webhook.start()
    context = ssl.create_default_context()
    ca.configure_trust(context)
    try:
        agent = await start_agent("gpu-1")
        settings = VerifierSettings(kubernetes_events=False)
        async with running(settings, bus_settings, bus_settings.nats_url or "", probe_listen="127.0.0.1:0") as verifier, \
                aiohttp.ClientSession(connector=aiohttp.TCPConnector(ssl=context)) as session:
            exported |= await scrape(agent.runtime.probe_url + "/metrics", session)
            exported |= await scrape(verifier.runtime.probe_url + "/metrics", session)
            exported |= await scrape(webhook.url + "/metrics", session)
    finally:
        await webhook.stop()
    for where, exprs in (("rule", rule_exprs()), ("panel", dashboard_exprs())):
        for name, expr in exprs.items():
            used = named_metrics(expr)
            assert used, f"{where} {name} names no metric of ours: {expr}"
            assert used <= exported, f"{where} {name} reads {sorted(used - exported)}, which no service exports"
    # And the alerts cover what the issue asks for.
    assert set(rule_exprs()) >= {"KaiIsolatorIsolationMissing", "KaiIsolatorBreach", "KaiIsolatorSelfCheckFailing", "KaiIsolatorNodeAgentDown",
                                 "KaiIsolatorVerifierLagging", "KaiIsolatorWebhookErrors", "KaiIsolatorWebhookSlow", "KaiIsolatorDeadLetters"}


def test_every_rule_is_labelled_and_explained() -> None:
    groups = yaml.safe_load((MONITORING / "prometheus-rules.yaml").read_text())["groups"]
    for rule in (r for g in groups for r in g["rules"]):
        assert rule["labels"]["severity"] in ("critical", "warning"), rule["alert"]
        assert rule["annotations"]["summary"] and rule["annotations"]["description"], rule["alert"]


def test_promtool_accepts_the_rules_and_each_alert_fires_in_its_unit_test() -> None:
    rule_checker = str(promtool())  # the pinned one, built and cached like the control plane
    checked = subprocess.run([rule_checker, "check", "rules", "prometheus-rules.yaml"], cwd=MONITORING, capture_output=True, text=True)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    tested = subprocess.run([rule_checker, "test", "rules", "prometheus-rules.test.yaml"], cwd=MONITORING, capture_output=True, text=True)
    assert tested.returncode == 0, tested.stdout + tested.stderr


def test_the_chart_ships_the_same_rules_and_dashboard() -> None:
    for name in ("prometheus-rules.yaml", "grafana-dashboard.json"):
        assert (CHART_FILES / name).read_text() == (MONITORING / name).read_text(), f"copy deploy/monitoring/{name} to {CHART_FILES}"
