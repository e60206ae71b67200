"""Builds quickdraft/prompts/agentic.json: the agentic replay set of `quickdraft bench --sets
agentic`, from this repository's own code.

A coding agent's edit/test loop, one session per source file: the system prompt with the tool
definitions, the task and `read_file`'s output (the whole file), then per turn the model's answer
(the complete updated file; `null` in the JSON: the benchmark puts the baseline engine's own
output there, as an agent's history holds the model's earlier answers) and the next tool
output (`write_file`, a pytest run quoting the failing function, a new request). Every request
resends the whole conversation: the same system prompt, tools and file, and the model's earlier
answers. The files are read at a fixed commit, so the set only changes when rebuilt on purpose:

    python bench/agentic_prompts.py [--commit REV]
"""

from __future__ import annotations

import argparse
import ast
import json
import subprocess
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "quickdraft" / "prompts" / "agentic.json"

TOOLS = [
    {
        "name": "read_file",
        "description": "Read a file of the repository.",
        "parameters": {"type": "object", "properties": {"path": {"type": "string"}}},
    },
    {
        "name": "write_file",
        "description": "Replace a file of the repository with new content.",
        "parameters": {
            "type": "object",
            "properties": {"path": {"type": "string"}, "content": {"type": "string"}},
        },
    },
    {
        "name": "run_tests",
        "description": "Run pytest on the given test files and return its output.",
        "parameters": {
            "type": "object",
            "properties": {"paths": {"type": "array", "items": {"type": "string"}}},
        },
    },
]

SYSTEM = (
    "You are a coding agent working in the quickdraft repository (a Python LLM inference "
    "engine). You change code with the tools below. When you edit a file, answer with the "
    "complete updated file in one ```python block and nothing else; the harness writes it with "
    "write_file and runs the tests.\n\nTools:\n" + json.dumps(TOOLS, indent=2)
)


@dataclass(frozen=True)
class Session:
    path: str  # the file the agent edits
    task: str
    test: str  # the failing test's node id after the first edit
    function: str  # the function the failure's traceback quotes
    error: str  # the assertion's message
    follow_up: str  # the task after the fix passes


SESSIONS = [
    Session(
        "quickdraft/speculation/state.py",
        "Add a method `Acceptance.reset()` that forgets every observation (successes, failures "
        "and idle_steps back to 0) while keeping the prior.",
        "tests/test_policy.py::test_acceptance_reset_keeps_the_prior",
        "update",
        "AssertionError: assert 0.62 == 0.5\n where 0.62 = Acceptance(prior_alpha=0.5, "
        "prior_weight=4.0, forget=0.97, successes=0.0, failures=0.0, idle_steps=0).alpha",
        "Now make `SpecState.record` call `acceptance.reset()` when a request's drafter was "
        "replaced (a new argument `replaced: bool = False`).",
    ),
    Session(
        "quickdraft/speculation/sampling.py",
        "`probabilities` must reject a temperature below 0 with a ValueError naming the value.",
        "tests/test_sampling.py::test_probabilities_rejects_negative_temperature",
        "probabilities",
        "Failed: DID NOT RAISE <class 'ValueError'>",
        "The error message must also name the parameter: 'temperature must be >= 0, got -1.0'.",
    ),
    Session(
        "quickdraft/bench/peers.py",
        "`LlamaCpp.generate` should also return the number of prompt tokens llama.cpp "
        "evaluated, in a new field `PeerRun.prompt_tokens`.",
        "tests/test_peers.py::test_llama_cpp_reports_prompt_tokens",
        "generate",
        "TypeError: PeerRun.__init__() missing 1 required positional argument: 'prompt_tokens'",
        "Give `prompt_tokens` a default of 0 so that older callers still work.",
    ),
    Session(
        "quickdraft/speculation/drafters/base.py",
        "`draft_one` must skip the logit controls when the request is greedy and has no "
        "grammar: add a fast path that takes the argmax of the raw logits.",
        "tests/test_logit_controls.py::test_draft_one_applies_bias_when_greedy",
        "draft_one",
        "AssertionError: assert [17] == [42]\n  the logit bias of token 42 (+100) was not applied",
        "Revert the fast path but keep a comment in `draft_one` saying why the controls must "
        "shape greedy drafts too.",
    ),
]


def source(path: str, commit: str) -> str:
    return subprocess.run(
        ["git", "show", f"{commit}:{path}"], cwd=ROOT, check=True, capture_output=True, text=True
    ).stdout


def function_lines(text: str, name: str) -> list[str]:
    """The source lines of the first function or method called `name`, numbered like pytest."""
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.FunctionDef) and node.name == name:
            lines = text.splitlines()[node.lineno - 1 : node.end_lineno]
            return [f"{node.lineno + i:>4}  {line}" for i, line in enumerate(lines)]
    raise ValueError(f"no function {name!r}")


def pytest_failure(s: Session, text: str) -> str:
    test_file = s.test.split("::")[0]
    body = "\n".join(function_lines(text, s.function))
    return (
        f"============================= test session starts ==============================\n"
        f"collected 14 items\n\n{test_file} .............F{' ' * 20}[100%]\n\n"
        f"=================================== FAILURES ===================================\n"
        f"_____ {s.test.split('::')[1]} _____\n\n{s.path}:\n{body}\n\nE   {s.error}\n\n"
        f"=========================== short test summary info ============================\n"
        f"FAILED {s.test} - {s.error.splitlines()[0]}\n"
        f"========================= 1 failed, 13 passed in 2.41s ========================="
    )


def session(s: Session, commit: str) -> list[dict[str, str | None]]:
    text = source(s.path, commit)
    test_file = s.test.split("::")[0]
    answer: dict[str, str | None] = {"role": "assistant", "content": None}
    return [
        {"role": "system", "content": SYSTEM},
        {
            "role": "user",
            "content": f"Task: {s.task}\n\nread_file({s.path!r}) returned:\n```python\n{text}```",
        },
        answer,
        {
            "role": "user",
            "content": f"write_file({s.path!r}) returned: ok\nrun_tests([{test_file!r}]) "
            f"returned:\n```\n{pytest_failure(s, text)}\n```\nFix it. Answer with the complete "
            "updated file.",
        },
        answer,
        {
            "role": "user",
            "content": f"write_file({s.path!r}) returned: ok\nrun_tests([{test_file!r}]) "
            f"returned:\n```\n14 passed in 2.38s\n```\n{s.follow_up} Answer with the complete "
            "updated file.",
        },
        answer,
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--commit", default="HEAD", help="where the files are read (HEAD)")
    commit = subprocess.run(
        ["git", "rev-parse", parser.parse_args().commit],
        cwd=ROOT,
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    data = {
        "about": f"Built by bench/agentic_prompts.py from the files at commit {commit}; each "
        "session is one request per null assistant turn, which the benchmark fills with the "
        "baseline's own earlier answers.",
        "sessions": [session(s, commit) for s in SESSIONS],
    }
    OUT.write_text(json.dumps(data, indent=1) + "\n")
    print(f"{OUT.relative_to(ROOT)}: {len(SESSIONS)} sessions from {commit}")


if __name__ == "__main__":
    main()
