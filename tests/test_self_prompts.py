"""``distill.self_prompts``: user messages the base writes after its chat template's user-turn header (Magpie)."""

from __future__ import annotations

import json
import shutil

import pytest
from test_distill import TASKS, base, config  # noqa: F401  (the module's base model fixture)

from mars.errors import ConfigError, DataError
from mars.training import distill, self_prompts
from mars.training.distill import BuiltinSource
from mars.training.self_prompts import SelfPromptsSource


def source(**kw) -> SelfPromptsSource:
    # a random model ends its turn rarely: short samples, enough batches for a few that do
    defaults = dict(n=3, max_new_tokens=12, batch_size=16, max_batches=40, exclude=[])
    return SelfPromptsSource(**{**defaults, **kw})


def run(src, base, work, **kw):  # noqa: F811
    return self_prompts.generate(src, base, work, dtype="float32", device="cpu", digest=distill.model_digest(base),
                                 log=lambda *_: None, **kw)


def test_the_user_turn_header_is_the_chat_templates_text_before_a_message(base):  # noqa: F811
    from mars.core.models import load_model

    _, tok = load_model(base)
    prefix, end = self_prompts.user_turn(tok)
    text = tok.apply_chat_template([{"role": "user", "content": "hello"}], tokenize=False)
    assert text.startswith(prefix) and text[len(prefix):].startswith("hello" + end)
    tok.chat_template = None
    with pytest.raises(ConfigError, match="no chat template"):
        self_prompts.user_turn(tok)


def test_kept_prompts_ended_their_turn_and_repeat_nothing_and_every_sample_is_counted(base, tmp_path):  # noqa: F811
    kept, counts = run(source(), base, tmp_path / "work")
    assert len(kept) == 3 and len({self_prompts.normal(k["prompt"]) for k in kept}) == 3
    assert all(k["prompt"] == k["prompt"].strip() and k["prompt"] for k in kept)
    sampled = [json.loads(line) for p in sorted((tmp_path / "work").glob("batch-*.jsonl"))
               for line in p.read_text().splitlines()]
    assert counts["sampled"] == len(sampled) == 16 * len(list((tmp_path / "work").glob("batch-*.jsonl")))
    assert counts["unended"] == sum(not r["ended"] for r in sampled) > 0
    by_id = {r["id"]: r for r in sampled}
    assert all(by_id[k["id"]]["ended"] and by_id[k["id"]]["prompt"] == k["prompt"] for k in kept)


def test_the_same_seed_gives_the_same_prompts_from_the_cache_without_the_model(base, tmp_path):  # noqa: F811
    copy = tmp_path / "base"
    shutil.copytree(base, copy)
    first, _ = run(source(), copy, tmp_path / "work")
    digest = distill.model_digest(copy)
    shutil.rmtree(copy)  # cached batches: no model needed
    again, _ = self_prompts.generate(source(), copy, tmp_path / "work", dtype="float32", device="cpu", digest=digest,
                                     log=lambda *_: None)
    fresh, _ = run(source(), base, tmp_path / "fresh")  # sampled anew: the same
    assert first == again == fresh
    other, _ = run(source(seed=1), base, tmp_path / "work")  # another seed: the old batches are not reused
    assert other != first


def test_evaluation_prompts_are_never_kept(base, tmp_path):  # noqa: F811
    first, _ = run(source(), base, tmp_path / "work")
    evaluation = tmp_path / "eval"
    evaluation.mkdir()
    (evaluation / "set.jsonl").write_text(json.dumps({"prompt": "  " + first[1]["prompt"].upper() + " "}) + "\n")
    kept, counts = run(source(exclude=[str(evaluation)]), base, tmp_path / "work")
    assert counts["evaluation"] == 1 and first[1]["prompt"] not in [k["prompt"] for k in kept]
    assert [k["prompt"] for k in kept[:1]] == [first[0]["prompt"]] and len(kept) == 3
    with pytest.raises(DataError, match="exclude: .*nothing-here: no such file"):
        run(source(exclude=[str(tmp_path / "nothing-here")]), base, tmp_path / "work")


def test_too_few_usable_prompts_is_an_error_naming_the_knobs(base, tmp_path):  # noqa: F811
    with pytest.raises(DataError, match=r"self_prompts: \d+ usable prompts of 50 .*raise max_batches"):
        run(source(n=50, max_batches=2), base, tmp_path / "work")


def test_the_distillation_answers_them_beside_the_other_sources(base, tmp_path):  # noqa: F811
    cfg = config(builtin=BuiltinSource(n=6), self_prompts=source())
    manifest = distill.distill(cfg, TASKS, base, tmp_path / "out", tmp_path / "work", progress=False)
    assert manifest["by_source"] == {"builtin": 6, "self_prompts": 3} and manifest["self_prompts"]["sampled"] > 0
    kept, _ = run(source(), base, tmp_path / "work" / "self_prompts")  # what the stage sampled, from its cache
    answered = {r["prompt"] for r in distill.read_rows(tmp_path / "out") if r["source"] == "self_prompts"}
    assert answered <= {k["prompt"] for k in kept} and 3 - manifest["empty_dropped"] <= len(answered) <= 3
    batches = sorted(p.name for p in (tmp_path / "work" / "self_prompts").glob("batch-*.jsonl"))
    # another pool starts the decoding over, but keeps the sampled prompts (their own fingerprint)
    distill.distill(config(builtin=BuiltinSource(n=6, seed=1), self_prompts=source()), TASKS, base,
                    tmp_path / "out", tmp_path / "work", progress=False)
    assert sorted(p.name for p in (tmp_path / "work" / "self_prompts").glob("batch-*.jsonl")) == batches


def test_bad_settings_are_named():
    with pytest.raises(ConfigError, match="temperature: invalid value 0"):
        SelfPromptsSource(n=1, temperature=0)
    with pytest.raises(ConfigError, match="max_batches: invalid value 0"):
        SelfPromptsSource(n=1, max_batches=0)
    assert SelfPromptsSource(n=100, batch_size=32).batches() == 10  # enough for 3n samples
