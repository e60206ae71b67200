"""`quickdraft bench --serve` against a real server on loopback: off and on alternate per level
and round, and the report says each round's ratio and their median."""

from __future__ import annotations

import json
import statistics
import tempfile
from pathlib import Path

import pytest

from quickdraft.bench.serving import LoadTest, markdown, run_load_test
from quickdraft.config import SpeculativeConfig


def test_rounds_alternate_and_report_each_ratio(
    tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))  # where the server's temp dir goes
    t = LoadTest(
        model=str(tiny_model_dir),
        dtype="fp32",
        spec=SpeculativeConfig(method="ngram", num_draft_tokens=3),
        concurrency=(1, 2),
        requests=2,
        max_tokens=6,
        rounds=2,
        threads=1,
        out_dir=tmp_path,
        device="cpu",
    )
    report = run_load_test(t)
    saved = json.loads(next(tmp_path.glob("serve-*.json")).read_text())
    assert saved["rounds"] == 2
    for level in ("1", "2"):
        ratios = report["round_ratios"][level]
        assert len(ratios) == 2 and all(r > 0 for r in ratios)
        assert report["speedup_on_vs_off"][level] == round(statistics.median(ratios), 3)
        for phase in ("off", "on"):
            # the level's figures pool both rounds: 2 requests a round, 6 tokens or fewer each
            got = report["results"][phase][level]
            assert got["requests"] == 4 and 4 <= got["output_tokens"] <= 24
    assert report["results"]["off"]["1"]["drafted"] == 0
    table = markdown(report)
    assert "alternated 2 times per level" in table
    assert " / ".join(f"{x:.2f}" for x in report["round_ratios"]["2"]) in table
    assert not list(scratch.glob("quickdraft-*")), "the server's temp dir (its token) was left"


def test_rounds_below_one_are_refused() -> None:
    with pytest.raises(ValueError, match="rounds must be >= 1"):
        LoadTest(rounds=0)


def test_an_admin_token_that_starts_with_a_dash_reaches_the_server(tmp_path: Path) -> None:
    """token_urlsafe draws tokens that start with "-" (1 in 64): the server's command line
    must still carry it as the value of --admin-token, not as an option."""
    from quickdraft.bench.serving import _server_cmd
    from quickdraft.cli import build_parser

    t = LoadTest(model="m", dtype="fp32", spec=SpeculativeConfig(method="ngram"))
    cmd = _server_cmd(t, 8000, "-Xy_z", tmp_path / "settings.json")
    args = build_parser().parse_args(cmd[cmd.index("serve") :])
    assert args.admin_token == "-Xy_z"
