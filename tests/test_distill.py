"""``mars distill``: the prompt pool, resumable shards, and rows that are the base model's own greedy outputs."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml

from mars.errors import ConfigError, DataError
from mars.training import distill
from mars.training.base import ModelConfig, TinyConfig, build_base, describe, save_base
from mars.training.distill import BuiltinSource, DatasetsSource, DistillConfig, JsonlSource, ReasoningGymSource
from mars.training.tasks import TaskFamily, TasksConfig

ROOT = Path(__file__).resolve().parents[1]
TASKS = TasksConfig(n_train=3, n_heldout=4, families={
    "gcd": TaskFamily(config={"min_numbers": 2, "max_numbers": 2, "min_value": 2, "max_value": 30}),
    "lcm": TaskFamily(pool=False),
})


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    """A small random tiny-profile base with a chat template (its greedy outputs are arbitrary but fixed)."""
    cfg = ModelConfig(tiny=TinyConfig(vocab_size=400, tokenizer_corpus=400, hidden_size=32, num_hidden_layers=2,
                                      intermediate_size=64))
    model, tok, info = build_base(cfg, seed=0)
    with torch.no_grad():
        # larger random weights: outputs differ by prompt (at the default init every prompt gets "\n\n\n...")
        torch.manual_seed(1)
        for weights in model.parameters():
            if weights.dim() == 2:
                weights.normal_(0, 0.3)
        model.get_input_embeddings().weight[len(tok):] = 0  # spare rows decode to no text: picks stay on real tokens
    # A random model never says EOS: a second stop token, one it emits for some prompts and not others
    from mars.decoding.generate import generate
    from mars.training import suite

    outs = [g.token_ids for g in generate(model, tok, [it.prompt for it in suite.train(24, 0)], tau=1.0,
                                          max_new_tokens=8)]
    stop = min(range(len(tok)), key=lambda t: abs(sum(t in o for o in outs) - len(outs) / 2))
    model.generation_config.eos_token_id = [tok.eos_token_id, stop]
    out = tmp_path_factory.mktemp("models") / "base"
    save_base(model, tok, describe(model, tok, info, "tiny"), out)
    return out


def config(**kw) -> DistillConfig:
    # fp32: greedy tokens independent of batch composition, so an uninterrupted run is the reference
    defaults = dict(enabled=True, builtin=BuiltinSource(n=24), max_new_tokens=8, hit_limit="keep", batch_size=3,
                    dtype="float32", threads=1, rows_per_shard=5)
    return DistillConfig(**{**defaults, **kw})


def rows_of(out: Path) -> list[dict]:
    return distill.read_rows(out)


def test_the_pool_takes_every_source_in_order_with_unique_ids(tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"prompt": "Name a color.", "id": "p1"}) + "\n\n" + json.dumps({"prompt": "Say hi."}) + "\n")
    cfg = config(reasoning_gym=ReasoningGymSource(enabled=True), builtin=BuiltinSource(n=4),
                 jsonl=JsonlSource(path=str(prompts)))
    pool, counts = distill.build_pool(cfg, TASKS)
    assert [p.source for p in pool] == ["reasoning_gym"] * 3 + ["builtin"] * 4 + ["jsonl"] * 2
    assert {p.family for p in pool[:3]} == {"gcd"}  # lcm is evaluation only (pool: false)
    assert [p.id for p in pool[-2:]] == ["p1", "prompts-3"] and pool[-1].family == "jsonl"
    assert counts["prompts"] == 9 and counts["by_source"] == {"reasoning_gym": 3, "builtin": 4, "jsonl": 2}
    assert len({p.id for p in pool}) == len(pool)


def test_bad_sources_are_errors_naming_where(tmp_path):
    with pytest.raises(ConfigError, match="no prompt source is on"):
        distill.build_pool(config(builtin=BuiltinSource(n=0)), TASKS)
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"prompt": "ok"}) + "\n" + json.dumps({"text": "no prompt column"}) + "\n")
    with pytest.raises(DataError, match=r"bad.jsonl:2: no text in column 'prompt'"):
        distill.build_pool(config(builtin=BuiltinSource(n=0), jsonl=JsonlSource(path=str(bad))), TASKS)
    bad.write_text(json.dumps({"prompt": "ok"}) + "\n" + "[" * 100_000 + "\n")  # past the JSON parser's depth
    with pytest.raises(DataError, match=r"bad.jsonl:2: not valid JSON \(nested too deeply\)"):
        distill.build_pool(config(builtin=BuiltinSource(n=0), jsonl=JsonlSource(path=str(bad))), TASKS)
    twice = tmp_path / "twice.jsonl"
    twice.write_text((json.dumps({"prompt": "a", "id": "x"}) + "\n") * 2)
    with pytest.raises(DataError, match="prompt ids repeat.*'x'"):
        distill.build_pool(config(builtin=BuiltinSource(n=0), jsonl=JsonlSource(path=str(twice))), TASKS)


def test_a_hub_data_set_fails_offline_naming_the_hub(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    cfg = config(builtin=BuiltinSource(n=0), datasets=DatasetsSource(name="HuggingFaceH4/ultrachat_200k"))
    with pytest.raises(DataError, match=r"distill\.datasets\.name: 'HuggingFaceH4/ultrachat_200k'.*needs the Hugging Face hub"):
        distill.build_pool(cfg, TASKS)


def test_a_local_dataset_column_of_chats_gives_the_first_user_turn(tmp_path):
    import datasets

    chats = [[{"role": "system", "content": "be brief"}, {"role": "user", "content": f"question {i}"},
              {"role": "assistant", "content": "answer"}] for i in range(3)]
    datasets.Dataset.from_dict({"messages": chats}).save_to_disk(tmp_path / "chats")
    cfg = config(builtin=BuiltinSource(n=0), datasets=DatasetsSource(name=str(tmp_path / "chats"),
                                                                     prompt_column="messages", n=2))
    pool, _ = distill.build_pool(cfg, TASKS)
    assert [p.prompt for p in pool] == ["question 0", "question 1"]


def test_distilled_rows_are_the_base_models_own_greedy_outputs(base, tmp_path):
    """Re-decode a sample with HF generate (greedy, fp32): the same tokens and the same text."""
    from mars.core.models import load_model
    from mars.decoding.generate import encode_prompts

    manifest = distill.distill(config(), TASKS, base, tmp_path / "out", tmp_path / "work", progress=False)
    rows = rows_of(tmp_path / "out")
    assert manifest["rows"] == len(rows) == 24 and manifest["generator_sha256"] == distill.model_digest(base)
    assert manifest["decoding"]["tau"] == 1.0 and manifest["decoding"]["dtype"] == "float32"
    shard_rows = [json.loads(line) for p in sorted((tmp_path / "work").glob("shard-*.jsonl"))
                  for line in p.read_text().splitlines()]
    model, tok = load_model(base)
    for row in [shard_rows[i] for i in (0, 7, 23)]:
        ids = encode_prompts(tok, [row["prompt"]])[0]
        out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                             do_sample=False, max_new_tokens=8, pad_token_id=tok.pad_token_id)
        generated = out[0, len(ids):].tolist()
        assert row["token_ids"] == generated
        assert next(r for r in rows if r["id"] == row["id"])["response"] == tok.decode(generated,
                                                                                      skip_special_tokens=True)


def test_responses_that_hit_the_limit_are_counted_and_kept_or_dropped(base, tmp_path):
    kept = distill.distill(config(), TASKS, base, tmp_path / "keep", tmp_path / "w1", progress=False)
    hit = kept["hit_limit"]["count"]
    assert hit > 0 and kept["rows"] == 24 - kept["empty_dropped"]  # a random model rarely says EOS in 8 tokens
    rows = rows_of(tmp_path / "keep")
    assert sum(r["finish_reason"] == "length" for r in rows) == hit and all(r["response_tokens"] <= 8 for r in rows)
    dropped = distill.distill(config(hit_limit="drop"), TASKS, base, tmp_path / "drop", tmp_path / "w1",
                              progress=False)
    assert dropped["hit_limit"] == {"count": hit, "policy": "drop", "max_new_tokens": 8}
    assert all(r["finish_reason"] == "stop" for r in rows_of(tmp_path / "drop"))
    assert dropped["rows"] == 24 - hit - dropped["empty_dropped"]


def _params(tmp_path: Path, cfg: dict) -> Path:
    raw = yaml.safe_load((ROOT / "params.yaml").read_text())
    raw["distill"] = cfg
    path = tmp_path / "params.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


@pytest.mark.slow  # two full runs of 240 prompts and a subprocess
def test_a_killed_run_resumes_with_no_row_lost_or_repeated(base, tmp_path):
    """SIGKILL the real command once its first shard is on disk; the rerun decodes only the missing
    shards, and the result is the uninterrupted run's, row for row."""
    cfg = dict(enabled=True, builtin={"n": 240}, max_new_tokens=48, hit_limit="keep", batch_size=2,
               dtype="float32", threads=1, rows_per_shard=4)
    params = _params(tmp_path, cfg)
    work, out = tmp_path / "work", tmp_path / "out"
    proc = subprocess.Popen([sys.executable, "-m", "mars.cli", "distill", "--params", str(params), "--base", str(base),
                             "--out", str(out), "--work", str(work), "--no-progress"], cwd=tmp_path,
                            env={**os.environ, "PYTHONPATH": str(ROOT)})
    deadline = time.monotonic() + 120
    while not any(work.glob("shard-*.jsonl")) and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.01)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    done = len(list(work.glob("shard-*.jsonl")))
    assert 0 < done < 60 and not out.exists(), "the kill must land mid-run for this test to mean anything"

    logs: list[str] = []
    full = distill.DistillConfig(enabled=True, builtin=BuiltinSource(n=240), max_new_tokens=48, hit_limit="keep",
                                 batch_size=2, dtype="float32", threads=1, rows_per_shard=4)
    distill.distill(full, TasksConfig(), base, out, work, progress=False, log=logs.append)
    assert logs == [f"distill: resuming, {done} of 60 shards already decoded"]
    resumed = rows_of(out)
    distill.distill(full, TasksConfig(), base, tmp_path / "fresh", tmp_path / "fresh_work", progress=False)
    assert len(resumed) == 240 and len({r["id"] for r in resumed}) == 240
    assert resumed == rows_of(tmp_path / "fresh")


def test_a_changed_pool_starts_over(base, tmp_path):
    distill.distill(config(), TASKS, base, tmp_path / "out", tmp_path / "work", progress=False)
    logs: list[str] = []
    manifest = distill.distill(config(builtin=BuiltinSource(n=24, seed=1)), TASKS, base, tmp_path / "out",
                               tmp_path / "work", progress=False, log=logs.append)
    # no shard of the old pool was reused (a reused one would not match the new pool's ids and fail)
    assert logs == [] and manifest["rows"] + manifest["empty_dropped"] == 24
    new_ids = [p.id for p in distill.build_pool(config(builtin=BuiltinSource(n=24, seed=1)), TASKS)[0]]
    old_ids = [p.id for p in distill.build_pool(config(), TASKS)[0]]
    assert set(new_ids) != set(old_ids) and {r["id"] for r in rows_of(tmp_path / "out")} <= set(new_ids)


def test_off_writes_a_manifest_that_says_so(base, tmp_path):
    manifest = distill.distill(DistillConfig(), TASKS, base, tmp_path / "out", tmp_path / "work", progress=False)
    assert manifest == {"format_version": distill.FORMAT_VERSION, "enabled": False}
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["manifest.json"]
    assert (tmp_path / "work").is_dir()


@pytest.mark.parametrize("profile", ["qwen2_5_0_5b", "qwen2_5_7b"])
def test_the_qwen_profiles_distill_stage_fails_offline_naming_what_needs_the_hub(profile, base, tmp_path):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-m", "mars.cli", "distill", "--params", str(ROOT / "params.yaml"),
                           "-S", f"profile={profile}", "--base", str(base), "--out", str(tmp_path / "out"),
                           "--work", str(tmp_path / "work")], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 1
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("mars distill: error: distill.datasets.name: 'HuggingFaceH4/ultrachat_200k'")
    assert "needs the Hugging Face hub" in last and not (tmp_path / "out").exists()
