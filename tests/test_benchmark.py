"""quickdraft.bench.speculative end to end on tiny random models: the A/B report's shape and figures
(per set and per prompt), and the files it writes. Speeds are not asserted (tests never
assert timings), only that they are measured and consistent."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest

from quickdraft.bench import speculative
from quickdraft.bench.speculative import (
    Run,
    SpecBench,
    bench_sets,
    decode_tok_s,
    fill,
    prompt_ids,
    run,
    session_requests,
)
from quickdraft.config import SpeculativeConfig
from quickdraft.loading import load
from quickdraft.speculation.factory import make_speculation


def tiny_run(model: Path, out_dir: Path, **fields: Any) -> dict[str, Any]:
    """`run` of a few fp32 tokens of the tiny model, no draft model unless given, no
    transformers reference and no references from the target (every test's common setting)."""
    settings: dict[str, Any] = {
        "draft": None,
        "dtype": "fp32",
        "tokens": 8,
        "per_set": 1,
        "sets": ("code",),
        "k": 3,
        "hf": False,
        "reference_per_set": 0,
    }
    settings.update(fields)
    draft = settings.pop("draft")
    return run(SpecBench(str(model), draft, out_dir=out_dir, **settings))


def test_benchmark_reports_sets_and_prompts(
    tiny_model_dir: Path, near_draft_dir: Path, tmp_path: Path
) -> None:
    report = tiny_run(
        tiny_model_dir,
        tmp_path,
        draft=str(near_draft_dir),
        tokens=12,
        per_set=2,
        sets=("code", "json"),
        draft_quantization="none",
    )
    assert list(report["results"]) == ["code", "json"]
    for row in report["results"].values():
        assert set(row) == {"none", "ngram", "suffix", "draft", "adaptive"}
        assert row["suffix"]["speedup_vs_ngram"] > 0
        assert row["adaptive"]["best_single"] in ("ngram", "suffix", "draft")
        assert row["adaptive"]["speedup_vs_best_single"] > 0
        for name, cell in row.items():
            assert cell["prompts"] == 2 and cell["tok_s"] > 0
            prompts = cell["per_prompt"]
            assert [p["prompt"] for p in prompts] == [0, 1]
            assert all(p["tok_s"] > 0 and 0 < p["tokens"] <= 12 for p in prompts)
            if name != "none":
                assert all(p["speedup"] > 0 for p in prompts)
                # fp32: speculation never changes greedy output
                assert cell["identical"] == 2 and cell["divergences"] == []
        draft = row["draft"]
        assert draft["mean_acceptance_length"] >= 1.0
        al = [p["mean_acceptance_length"] for p in draft["per_prompt"]]
        assert min(al) <= draft["mean_acceptance_length"] <= max(al)
    saved = json.loads((tmp_path / "speculative.json").read_text())
    assert (
        saved["results"]["code"]["draft"]["per_prompt"]
        == report["results"]["code"]["draft"]["per_prompt"]
    )
    table = (tmp_path / "speculative.md").read_text()
    assert "| code | draft | 2 |" in table
    assert (tmp_path / "speculative.png").stat().st_size > 0


def test_benchmark_without_a_draft_model_runs_the_other_engines(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    """A target with no packaged draft (and none given): off, the lookups and adaptive over
    them only, no error."""
    report = tiny_run(tiny_model_dir, tmp_path)
    assert report["draft"] is None
    assert set(report["results"]["code"]) == {"none", "ngram", "suffix", "adaptive"}
    assert "no draft model" in (tmp_path / "speculative.md").read_text()


def test_benchmark_no_adaptive_reaches_every_engine(tiny_model_dir: Path, tmp_path: Path) -> None:
    """`quickdraft bench --no-adaptive`: the engines draft k every cycle (the cost model off,
    said in the report and the table) and the adaptive engine, which needs the cost model to
    price its drafters, is left out; it used to be dropped silently, every engine adaptive."""
    from quickdraft.cli import main as cli_main

    argv = ["bench", "--model", str(tiny_model_dir), "--dtype", "fp32", "--max-tokens", "8"]
    argv += ["--per-set", "1", "--sets", "code", "--num-draft-tokens", "3", "--no-hf"]
    argv += ["--reference-per-set", "0", "--no-adaptive", "--out", str(tmp_path)]
    assert cli_main(argv) == 0
    saved = json.loads((tmp_path / "speculative.json").read_text())
    assert saved["cost_model"] is False
    assert set(saved["results"]["code"]) == {"none", "ngram", "suffix"}
    assert "k = 3 every cycle (no cost model)" in (tmp_path / "speculative.md").read_text()
    report = tiny_run(tiny_model_dir, tmp_path / "on")
    assert report["cost_model"] is True and "adaptive" in report["results"]["code"]


def test_benchmark_runs_a_model_without_a_chat_template(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    """A base model with no chat template (gemma3-270m): the set's prompts run as plain
    completions, every engine on the same ids, outputs identical to speculation off."""
    model = tmp_path / "base"
    shutil.copytree(tiny_model_dir, model)
    cfg_path = model / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg.pop("chat_template")
    cfg_path.write_text(json.dumps(cfg))
    (model / "chat_template.jinja").unlink(missing_ok=True)
    lm = load(str(model), "fp32")
    assert lm.tokenizer.chat_template is None
    prompt = bench_sets()["code"][0]
    assert isinstance(prompt, str)
    ids = prompt_ids(lm, [{"role": "user", "content": prompt}])
    assert ids == lm.tokenizer.encode(prompt + "\n\n")
    report = tiny_run(model, tmp_path / "out")
    code = report["results"]["code"]
    assert code["ngram"]["identical"] == code["suffix"]["identical"] == 1


def test_benchmark_rejects_negative_reference_count(tiny_model_dir: Path) -> None:
    with pytest.raises(ValueError, match="reference_per_set"):
        SpecBench(str(tiny_model_dir), reference_per_set=-1)


def test_benchmark_decode_rate_leaves_out_the_first_token() -> None:
    runs = [Run([1, 2, 3, 4, 5], seconds=3.0, ttft=1.0), Run([1, 2, 3], seconds=2.0, ttft=1.0)]
    assert decode_tok_s(runs) == pytest.approx((4 + 2) / (2.0 + 1.0))
    assert decode_tok_s([Run([1], 1.0, float("nan"))]) is None  # no TTFT (transformers)


def test_benchmark_rejects_unknown_peer(tiny_model_dir: Path) -> None:
    with pytest.raises(ValueError, match="unknown peers"):
        SpecBench(str(tiny_model_dir), peers=("vllm",))


def test_benchmark_agentic_sessions_expand_to_one_request_per_answer() -> None:
    session = [
        {"role": "system", "content": "s"},
        {"role": "user", "content": "u1"},
        {"role": "assistant", "content": None},
        {"role": "user", "content": "u2"},
        {"role": "assistant", "content": None},
    ]
    first, second = session_requests(session)
    assert first == session[:2] and second == session[:4]
    assert fill(second, ["a1"])[2] == {"role": "assistant", "content": "a1"}
    assert fill(first, []) == first
    assert session_requests("p") == [[{"role": "user", "content": "p"}]]
    with pytest.raises(AssertionError):
        fill(first, ["extra"])
    agentic = bench_sets()["agentic"]
    assert len(agentic) >= 4 and all(len(session_requests(s)) == 3 for s in agentic)


def test_benchmark_runs_agentic_sessions(
    tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A short session through the bench (the shipped one is longer than the tiny model's
    context): every turn is a request of every engine, greedy output identical."""
    session = [
        {"role": "user", "content": "abcabc"},
        {"role": "assistant", "content": None},
        {"role": "user", "content": "again: abcabc"},
        {"role": "assistant", "content": None},
    ]
    monkeypatch.setattr(speculative, "bench_sets", lambda: {"agentic": [session, session]})
    report = tiny_run(tiny_model_dir, tmp_path, per_set=3, sets=("agentic",))
    row = report["results"]["agentic"]
    assert row["none"]["prompts"] == 3 and row["suffix"]["identical"] == 3
    assert "| agentic | suffix | 3 |" in (tmp_path / "speculative.md").read_text()
    # each engine's prefix cache served the resent conversation: the second request of a
    # session starts with the first's prompt and answer, the third with the second's
    assert report["agentic_prefix_cache"] is True
    for name in ("none", "ngram", "suffix", "adaptive"):
        cache = row[name]["prefix_cache"]
        assert 0 < cache["hits"] < cache["queries"], name
    off = tiny_run(
        tiny_model_dir, tmp_path / "off", per_set=3, sets=("agentic",), prefix_cache=False
    )
    assert (
        off["agentic_prefix_cache"] is False
        and "prefix_cache" not in off["results"]["agentic"]["none"]
    )
    for name in ("none", "ngram", "suffix"):  # the same greedy tokens with the cache and without
        assert [p["tokens"] for p in off["results"]["agentic"][name]["per_prompt"]] == [
            p["tokens"] for p in row[name]["per_prompt"]
        ]


def test_benchmark_runs_the_transformers_references_on_our_device(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    """The transformers baselines load the same weights on the device our engines run on (the
    CPU here) and, greedy in fp32, emit what speculation off emits."""
    code = tiny_run(tiny_model_dir, tmp_path, hf=True, reference_per_set=1)["results"]["code"]
    for name in ("hf", "hf_prompt_lookup"):
        assert code[name]["identical"] == 1 and code[name]["tok_s"] > 0


def test_serve_batch_serves_every_prompt_the_same_with_speculation(tiny_model_dir: Path) -> None:
    """A closed batch served two at a time: every request gets its `tokens` ids, speculation
    (n-gram, forced to draft) gives speculation off's outputs, and the core's counters come
    back (drafted rows only with a drafter)."""
    lm = load(str(tiny_model_dir), "fp32")
    prompts = [[1, 2, 3, 1, 2, 3, 1, 2], [5, 6, 7, 5, 6, 7], [9, 8, 9, 8, 9]]
    spec = make_speculation(lm, SpeculativeConfig(method="ngram", adaptive=False))
    off = speculative.serve_batch(lm, None, prompts, 10, 2)
    on = speculative.serve_batch(lm, spec, prompts, 10, 2)
    assert [len(o) for o in off.outputs] == [10, 10, 10]
    assert on.outputs == off.outputs
    assert off.tok_s > 0 and on.tok_s > 0
    assert off.stats.steps > 0 and off.stats.draft_rows == 0
    assert on.stats.draft_rows > 0


def test_compare_pairs_each_round_with_speculation_off(tiny_model_dir: Path) -> None:
    """`compare` runs every method over the same prompts in each round: one ratio to off per
    round, off's own ratios all 1, drafting counted only where a drafter drafts, and a forced
    n-gram drafter's outputs equal off's."""
    lm = load(str(tiny_model_dir), "fp32")
    prompts = [[1, 2, 3, 1, 2, 3, 1, 2], [5, 6, 7, 5, 6, 7]]
    spec = make_speculation(lm, SpeculativeConfig(method="ngram", adaptive=False))
    got = speculative.compare(lm, {"off": None, "ngram": spec}, prompts, 8, 1, 2)
    off, ngram = got["off"], got["ngram"]
    assert off["round_ratios"] == [1.0, 1.0] and off["paired_speedup"] == 1.0
    assert off["acceptance_rate"] is None and off["drafted_per_step"] == 0
    assert len(ngram["round_ratios"]) == 2 and ngram["drafted_per_step"] > 0
    assert ngram["identical_outputs"] and 0.0 <= ngram["acceptance_rate"] <= 1.0


def test_reports_name_the_cpu_by_family_model_and_stepping(tmp_path: Path) -> None:
    """A report's host line carries family.model.stepping where /proc/cpuinfo has them (two
    VMs of one model name and one flag set were different CPUs); a report written before the
    field existed renders as it did."""
    from quickdraft.bench import report

    got = report.cpu_id()
    if Path("/proc/cpuinfo").exists() and "cpu family" in Path("/proc/cpuinfo").read_text():
        parts = got.split(".")
        assert len(parts) == 3 and all(p.isdigit() for p in parts), got
    m = {"cpu": "Some CPU", "isa": ["avx2"], "commit": "abc1234", "gpu": None}
    for machine, line in (
        ({**m, "cpu_id": "6.207.2"}, "Some CPU, 6.207.2 (avx2), commit abc1234"),
        (m, "Some CPU (avx2), commit abc1234"),
    ):
        report.write("r", {"machine": machine}, "# t\n", lambda fig: None, tmp_path)
        assert (tmp_path / "r.md").read_text() == f"# t\n\n{line}\n"
    assert report.machine()["cpu_id"] == got
