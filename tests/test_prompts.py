"""The prompt files that ship with the project: the pool sources (prompts/) and the evaluation sets
(benchmarks/prompts/), which no pool may contain."""

from __future__ import annotations

import json
from pathlib import Path

from mars.training.self_prompts import excluded, normal  # what the pool leaves out, and when two prompts are the same

ROOT = Path(__file__).resolve().parents[1]


def prompts(path: Path) -> list[str]:
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    assert all(isinstance(r["prompt"], str) and r["prompt"].strip() for r in rows), path
    assert len({r.get("id", i) for i, r in enumerate(rows)}) == len(rows), f"{path}: repeated ids"
    return [r["prompt"] for r in rows]


def test_the_shipped_sets_have_their_sizes():
    assert len(prompts(ROOT / "prompts" / "self_instruct_seed.jsonl")) == 175
    assert len(prompts(ROOT / "benchmarks" / "prompts" / "user_oriented.jsonl")) == 252
    assert len(prompts(ROOT / "benchmarks" / "prompts" / "chat.jsonl")) == 40


def test_no_evaluation_prompt_is_in_a_pool_source():
    evaluation = excluded([str(ROOT / "benchmarks" / "prompts")])
    for source in (ROOT / "prompts").glob("*.jsonl"):
        pool = {normal(p) for p in prompts(source)}
        # (a generic instruction such as "Answer the following question." may recur with another input)
        assert not pool & evaluation, f"{source.name}: {sorted(pool & evaluation)[:3]}"
