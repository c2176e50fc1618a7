"""Write the PrometheusRule of deploy/k8s/components/prometheus-operator from rules.yml (the one
source of the rules): ``python deploy/prometheus/prometheusrule.py > \\
deploy/k8s/components/prometheus-operator/prometheusrule.yaml``. A test checks they agree.

``--runbook-base URL`` prefixes every alert's ``runbook_url`` (``deploy/README.md#<alert>``,
relative to the repository) with where your copy is hosted, e.g.
``https://git.example.com/ml/tether/blob/main/``, so the links open from Alertmanager."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import yaml

RULES = Path(__file__).resolve().parent / "rules.yml"
HEADER = """\
# Generated from deploy/prometheus/rules.yml by deploy/prometheus/prometheusrule.py: edit the
# rules there and regenerate (tests/services/test_deploy_k8s.py checks that the two agree).
"""


def render(rules_text: str, *, runbook_base: str = "") -> str:
    groups = yaml.safe_load(rules_text)["groups"]
    for group in groups:
        for r in group["rules"]:
            if runbook_base and "runbook_url" in r.get("annotations", {}):
                r["annotations"]["runbook_url"] = runbook_base + r["annotations"]["runbook_url"]
    rule = {
        "apiVersion": "monitoring.coreos.com/v1",
        "kind": "PrometheusRule",
        "metadata": {
            "name": "tether",
            "labels": {"app.kubernetes.io/name": "tether", "app.kubernetes.io/part-of": "tether"},
        },
        "spec": {"groups": groups},
    }
    return HEADER + yaml.safe_dump(rule, sort_keys=False, width=100, allow_unicode=True)


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runbook-base", default="", help="prefix of every runbook_url")
    sys.stdout.write(render(RULES.read_text(), runbook_base=p.parse_args().runbook_base))
