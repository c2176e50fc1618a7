"""`tether report`: a self-contained HTML file with embedded PNG plots, from a copy of a real short
run's directory (tests/fixtures/run_thin: config.toml, metrics.jsonl and the status.json snapshot
collected from that run's Redis after it ended)."""

from __future__ import annotations

import argparse
import base64
import json
import re
import shutil
from pathlib import Path

import pytest

from tests.paths import FIXTURES
from tether.cli.observe_verbs import add_observe_verbs
from tether.runs.report.data import SECTIONS
from tether.runs.report.page import write_report

FIXTURE = FIXTURES / "run_thin"
IMG = re.compile(r'<img src="data:image/png;base64,([A-Za-z0-9+/=]+)"')


@pytest.fixture
def run_dir(tmp_path: Path) -> Path:
    return Path(shutil.copytree(FIXTURE, tmp_path / "thin"))


def pngs(page: str) -> list[bytes]:
    return [base64.b64decode(m) for m in IMG.findall(page)]


def section(page: str, key: str) -> str:
    start = page.index(f'<section id="{key}">')
    return page[start : page.index("</section>", start)]


def test_report_has_every_section_and_its_plots(run_dir: Path):
    path = write_report(run_dir)
    assert path == run_dir / "report.html"
    page = path.read_text(encoding="utf-8")
    images = pngs(page)
    # reward, throughput per step, rates per stage, staleness, mismatch, time breakdown
    assert len(images) == 6
    assert all(img.startswith(b"\x89PNG\r\n\x1a\n") and len(img) > 5_000 for img in images)
    for key, title in SECTIONS.items():
        if key != "episodes":  # a single-turn run has no episodes section
            assert title in section(page, key), key
    assert 'id="episodes"' not in page
    for key in ("reward", "throughput", "staleness", "mismatch", "time"):
        assert IMG.search(section(page, key)), f"no plot in section {key}"
    assert "0.0% → 0.0%" in section(page, "summary")  # held-out accuracy before → after
    books = section(page, "accounting")
    assert re.search(r"generated for training</td><td class=\"num\">48<", books)
    assert re.search(r"trained</td><td class=\"num\">48<", books)
    assert '<tr class="ok"><td>unaccounted</td><td class="num">0<' in books
    assert "name = &quot;thin&quot;" in section(page, "config")
    assert "http://" not in page and "https://" not in page  # self-contained: nothing fetched


def test_report_without_snapshot_still_draws_the_step_plots(run_dir: Path):
    (run_dir / "status.json").unlink()
    with (run_dir / "metrics.jsonl").open("a") as f:
        f.write('{"kind": "step", "step": 4, "rew')  # a line cut short by a crash
    page = write_report(run_dir, out=run_dir / "sub" / "r.html").read_text(encoding="utf-8")
    assert len(pngs(page)) == 4  # reward, throughput, staleness, mismatch
    assert "no status snapshot (status.json)" in section(page, "time")
    assert "no status snapshot (status.json)" in section(page, "accounting")


def test_an_episodes_run_shows_tool_use_over_steps(run_dir: Path):
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    steps = [json.loads(x) for x in lines if '"kind": "step"' in x]
    with (run_dir / "metrics.jsonl").open("w") as f:
        for k, rec in enumerate(steps):  # the same run, as if its episodes used a tool more
            rec.update(episode_turns_mean=1 + k / 4, tool_calls_per_episode=k / 4,
                       tool_call_rate=min(1.0, k / 4), tool_error_rate=0.1,
                       tool_seconds_per_episode=0.01, template_mismatches=0,
                       episodes_cut_max_turns=0, episode_version_span_max=1)  # fmt: skip
            f.write(json.dumps(rec) + "\n")
    page = write_report(run_dir).read_text(encoding="utf-8")
    episodes = section(page, "episodes")
    assert SECTIONS["episodes"] in episodes and IMG.search(episodes)
    assert len(pngs(page)) == 7


def test_report_cli(run_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    parser = argparse.ArgumentParser(prog="tether")
    add_observe_verbs(parser.add_subparsers())
    args = parser.parse_args(["report", str(run_dir), "--out", str(tmp_path / "out.html")])
    assert args.func(args) == 0
    assert (tmp_path / "out.html").exists() and "report written to" in capsys.readouterr().out
    args = parser.parse_args(["report", str(tmp_path / "nothing-here")])
    assert args.func(args) == 2
    assert "not a Tether run directory" in capsys.readouterr().err
