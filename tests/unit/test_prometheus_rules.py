"""The shipped alert rules are valid Prometheus rules, and each alert fires on the series it
is for, with its labels and texts, and stays quiet beside them (promtool's own rule tests,
deploy/prometheus/kvfence-alerts.test.yaml). A real Prometheus evaluates them against a
real cluster in tests/pd/test_cluster_prometheus.py."""
import subprocess
from pathlib import Path

from required_tools import tool_or_skip

HERE = Path(__file__).resolve().parents[2] / "deploy" / "prometheus"


def _promtool(*args: str) -> subprocess.CompletedProcess:
    exe = tool_or_skip("promtool", purpose="the alert rules' checks", install="Debian package 'prometheus'")
    return subprocess.run([exe, *args], cwd=HERE, capture_output=True, text=True, timeout=120)


def test_the_rules_are_valid():
    r = _promtool("check", "rules", "kvfence-alerts.yaml")
    assert r.returncode == 0 and "SUCCESS: 23 rules found" in r.stdout, r.stdout + r.stderr


def test_each_alert_fires_on_what_it_is_for_and_only_there():
    r = _promtool("test", "rules", "kvfence-alerts.test.yaml")
    assert r.returncode == 0 and "SUCCESS" in r.stdout, r.stdout + r.stderr


def test_every_alert_has_a_test_case():
    import yaml

    alerts = {rule["alert"] for g in yaml.safe_load((HERE / "kvfence-alerts.yaml").read_text())["groups"]
              for rule in g["rules"]}
    tested = {case["alertname"] for t in yaml.safe_load((HERE / "kvfence-alerts.test.yaml").read_text())["tests"]
              for case in t["alert_rule_test"] if case.get("exp_alerts")}
    assert alerts == tested, alerts ^ tested


def test_the_scrape_configuration_in_the_docs_is_valid(tmp_path):
    """docs/monitoring.md's prometheus.yml, with its files made up here, passes promtool."""
    import re

    doc = (HERE.parents[1] / "docs" / "monitoring.md").read_text()
    (config,) = re.findall(r"```yaml\n(.*?)```", doc, re.S)
    for name in ("ca.crt", "prometheus.crt", "prometheus.key", "kvfence-scrape.key"):
        (tmp_path / name).write_text("x\n")
    config = config.replace("/etc/prometheus/kvfence-alerts.yaml", str(HERE / "kvfence-alerts.yaml"))
    config = config.replace("/etc/prometheus/kvfence-scrape.key", str(tmp_path / "kvfence-scrape.key"))
    (tmp_path / "prometheus.yml").write_text(config)
    r = _promtool("check", "config", str(tmp_path / "prometheus.yml"))
    assert r.returncode == 0 and "SUCCESS: 23 rules found" in r.stdout, r.stdout + r.stderr
