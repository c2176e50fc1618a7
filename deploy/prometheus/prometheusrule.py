"""Write the PrometheusRule of deploy/k8s/components/prometheus-operator from rules.yml (the one
source of the rules): ``python deploy/prometheus/prometheusrule.py > \\
deploy/k8s/components/prometheus-operator/prometheusrule.yaml``. A test checks they agree."""

from __future__ import annotations

import sys
from pathlib import Path

import yaml

RULES = Path(__file__).resolve().parent / "rules.yml"
HEADER = """\
# Generated from deploy/prometheus/rules.yml by deploy/prometheus/prometheusrule.py: edit the
# rules there and regenerate (tests/services/test_deploy_k8s.py checks that the two agree).
"""


def render(rules_text: str) -> str:
    rule = {
        "apiVersion": "monitoring.coreos.com/v1",
        "kind": "PrometheusRule",
        "metadata": {
            "name": "tether",
            "labels": {"app.kubernetes.io/name": "tether", "app.kubernetes.io/part-of": "tether"},
        },
        "spec": {"groups": yaml.safe_load(rules_text)["groups"]},
    }
    return HEADER + yaml.safe_dump(rule, sort_keys=False, width=100, allow_unicode=True)


if __name__ == "__main__":
    sys.stdout.write(render(RULES.read_text()))
