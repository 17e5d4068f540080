"""lm-evaluation-harness: MARS as an lm-eval model (``mars lm-eval --model mars``), the local tasks,
and lm-eval tasks in the evaluate stage beside the built-in benchmarks.

The model is the default profile's at test size: its tokenizer and chat format (``mars base``), the
built-in suite prepared by ``mars prepare`` (its held-out split is the shipped ``mars_heldout`` task),
and a short MARS training run.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from mars.cli import main as mars_main
from mars.config import build
from mars.errors import ConfigError, MarsError
from mars.evaluation import evaluate, harness
from mars.evaluation.benchmarks import BenchmarkConfig
from mars.evaluation.evaluate import EvalConfig, read_jsonl
from mars.evaluation.gate import Evidence, GateConfig, decide
from mars.evaluation.harness import LmEvalConfig
from mars.evaluation.lm_eval_tasks import TASKS_DIR, data
from mars.evaluation.metric_key import MetricKey

ROOT = Path(__file__).resolve().parents[1]
TAU = 0.3  # low enough that the briefly trained model accepts several slots per forward


@pytest.fixture(scope="module")
def default_base(tmp_path_factory):
    """``(base model, prepared data)``: `mars base` and `mars prepare` with the default profile's settings."""
    from mars.training.base import ModelConfig, make_base
    from mars.training.data import DataConfig, prepare

    root = tmp_path_factory.mktemp("tiny")
    make_base(ModelConfig(), 0, root / "base")
    prepare(DataConfig(n_train=2000), root / "base", root / "data")
    return root / "base", root / "data"


@pytest.fixture(scope="module")
def default_profile(default_base, tmp_path_factory):
    """``(checkpoint, prepared data)``: 300 MARS steps from the base (~20 s): varied generations, and a
    few slots accepted per forward at a low tau."""
    from mars.training.trainer import TrainConfig, load_examples, train

    base, data_dir = default_base
    cfg = build(TrainConfig, {"lr": 5e-3, "batch_size": 16, "threads": 1, "save_every": 1000,
                              "mars": {"max_steps": 300}}, "train")
    examples, _ = load_examples(data_dir, cfg.max_length)
    out = tmp_path_factory.mktemp("mars")
    result = train(cfg, stage="mars", init=base, examples=examples, out=out, metrics_path=out / "train.tsv",
                   progress=False)
    return result.final_dir, data_dir


def local_manager():
    """lm-eval's task index over the local tasks only (the full index takes seconds to build)."""
    from lm_eval.tasks import TaskManager

    return TaskManager(include_path=str(TASKS_DIR), include_defaults=False)


def test_the_local_tasks_data_is_what_the_generators_give():
    """mars_heldout is the default profile's held-out suite, mars_gsm the gsm benchmark's pool."""
    for name, rows in data.FILES.items():
        shipped = read_jsonl(TASKS_DIR / name)
        assert shipped == rows(), f"{name} is stale: python -m mars.evaluation.lm_eval_tasks.data"
    assert len(read_jsonl(TASKS_DIR / data.HELDOUT_FILE)) == 400


@pytest.mark.slow
def test_evaluate_runs_a_local_lm_eval_task_exactly_as_its_benchmark_and_the_gate_reads_it(default_profile, tmp_path):
    """The held-out suite twice in one evaluate run, as the heldout benchmark and as the lm-eval task
    mars_heldout: the same prompt ids, generations, scores and decoding work, item for item, at every
    tau and in lossless mode."""
    ckpt, data_dir = default_profile
    cfg = EvalConfig(taus=[1.0, TAU], batch_size=16, benchmarks={"heldout": BenchmarkConfig(n=0, max_new_tokens=48)},
                     lm_eval=LmEvalConfig(tasks=["mars_heldout"]))
    metrics = evaluate.run({"mars": str(ckpt), "ar_control": str(ckpt)}, cfg, data_dir=str(data_dir),
                           out_dir=tmp_path / "eval", metrics_path=tmp_path / "eval.json", train_metrics_dir=None,
                           log=lambda *_: None)
    for tau in (1.0, TAU, None):  # None: lossless
        bench, task = MetricKey("mars", "heldout", tau), MetricKey("mars", "mars_heldout", tau)
        ours = {r["id"]: r for r in read_jsonl(bench.outputs_path(tmp_path / "eval"))}
        theirs = {r["id"]: r for r in read_jsonl(task.outputs_path(tmp_path / "eval"))}
        assert sorted(ours) == sorted(theirs) and len(ours) == 400
        for key in ("prompt_token_ids", "token_ids", "text", "forwards", "score"):
            assert [theirs[i][key] for i in ours] == [ours[i][key] for i in ours], (tau, key)
        a, b = metrics[bench.format()], metrics[task.format()]
        same = ("score", "tokens", "forwards", "n", "tau", "mode", "block_size")
        assert {k: b[k] for k in same} == {k: a[k] for k in same}
        assert b["metric"] == "score,none" and b["harness"] == "lm-eval"
    assert metrics["mars/mars_heldout/lossless"]["score"] == metrics["mars/mars_heldout/tau=1.0"]["score"]
    assert metrics[f"mars/mars_heldout/tau={TAU}"]["tokens_per_forward"] > 1.1, "several tokens per forward"
    assert (tmp_path / "eval" / "mars" / "lm_eval" / f"tau={TAU}.json").is_file()
    # the gate reads lm-eval entries as it reads a benchmark's (the two names hold the same checkpoint)
    on_disk = json.loads((tmp_path / "eval.json").read_text())
    # the fixture's short-trained toy scores under 15%: judged anyway
    gate = GateConfig(benchmarks=["mars_heldout"], tolerance=0.0, speed_tau=TAU, min_baseline_score=0.0)
    evidence = Evidence(tmp_path / "eval")
    first = decide(on_disk, gate, evidence)
    assert first["passed"], first["failures"]
    on_disk["mars/mars_heldout/tau=1.0"]["score"] -= 0.5  # no longer what its per-item outputs say
    decision = decide(on_disk, gate, evidence)
    assert not decision["passed"] and any("mars_heldout" in f for f in decision["failures"])


@pytest.mark.slow
def test_mars_lm_eval_command_gives_mars_evaluate_outputs_and_score(default_profile, tmp_path):
    """`mars lm-eval --model mars` on the local task: the per-item outputs and the score of `mars evaluate`."""
    ckpt, data_dir = default_profile
    cfg = EvalConfig(taus=[TAU], lossless=False, benchmarks={"heldout": BenchmarkConfig(n=0, max_new_tokens=48)})
    metrics = evaluate.run({"mars": str(ckpt)}, cfg, data_dir=str(data_dir), out_dir=tmp_path / "eval",
                           metrics_path=tmp_path / "eval.json", train_metrics_dir=None, log=lambda *_: None)
    ours = {r["id"]: r for r in read_jsonl(tmp_path / "eval" / "mars" / "heldout" / f"tau={TAU}.jsonl")}
    rc = mars_main(["lm-eval", "--model", "mars", "--model_args", f"pretrained={ckpt},tau={TAU},batch_size=16",
                    "--device", "cpu", "--tasks", "mars_heldout", "--apply_chat_template", "--log_samples",
                    "--output_path", str(tmp_path / "lm")])
    assert rc == 0
    (samples,) = (tmp_path / "lm").glob("*/samples_mars_heldout_*.jsonl")
    theirs = {r["doc"]["id"]: r for r in read_jsonl(samples)}
    assert sorted(theirs) == sorted(ours)
    assert [theirs[i]["resps"][0][0] for i in ours] == [ours[i]["text"] for i in ours]
    assert [theirs[i]["score"] for i in ours] == [ours[i]["score"] for i in ours]
    (results,) = (tmp_path / "lm").glob("*/results_*.json")
    results = json.loads(results.read_text())
    assert results["results"]["mars_heldout"]["score,none"] == pytest.approx(metrics[f"mars/heldout/tau={TAU}"]["score"])
    work = results["config"]["mars"]["tasks"]["mars_heldout"]
    assert (work["tokens"], work["forwards"]) == (metrics[f"mars/heldout/tau={TAU}"]["tokens"],
                                                 metrics[f"mars/heldout/tau={TAU}"]["forwards"])


@pytest.mark.slow
def test_tau_one_through_lm_eval_is_lm_evals_own_hf_model_greedy(default_profile):
    from lm_eval import simple_evaluate

    import mars.evaluation.lm_eval_model  # noqa: F401  (registers "mars")

    ckpt, _ = default_profile
    outputs = {}
    for name, model, args in (("hf", "hf", {"dtype": "float32"}), ("mars", "mars", {"tau": 1.0}),
                              ("tree", "mars", {"mode": "lossless", "tree": "top2/6"})):
        results = simple_evaluate(model=model, model_args={"pretrained": str(ckpt), "device": "cpu", **args},
                                  tasks=["mars_heldout"], task_manager=local_manager(), limit=96, batch_size=16,
                                  apply_chat_template=True)
        outputs[name] = [s["resps"][0][0] for s in sorted(results["samples"]["mars_heldout"], key=lambda s: s["doc_id"])]
    assert len(outputs["mars"]) == 96
    assert outputs["mars"] == outputs["hf"] == outputs["tree"]
    assert len(set(outputs["hf"])) > 10, "the comparison means something: varied generations"


@pytest.mark.slow
def test_stop_strings_end_generations_as_lm_eval_cuts_them(default_profile):
    """An ``until`` string cuts the text (as lm-eval's hf model does) and ends the decoding there."""
    from lm_eval import simple_evaluate

    from mars.evaluation.lm_eval_model import MarsLM

    ckpt, _ = default_profile
    lm = MarsLM(str(ckpt), tau=TAU, batch_size=8, device="cpu")
    free = simple_evaluate(model=lm, tasks=["mars_heldout"], task_manager=local_manager(), limit=8,
                           apply_chat_template=True)
    texts = [s["resps"][0][0] for s in free["samples"]["mars_heldout"]]
    stop = next(t.strip()[:2] for t in texts if len(t.strip()) > 3)
    lm = MarsLM(str(ckpt), tau=TAU, batch_size=8, device="cpu")
    cut = simple_evaluate(model=lm, tasks=["mars_heldout"], task_manager=local_manager(), limit=8,
                          apply_chat_template=True, gen_kwargs={"until": [stop]})
    assert [s["resps"][0][0] for s in cut["samples"]["mars_heldout"]] == [t.split(stop)[0] for t in texts]
    assert any(g["finish_reason"] == "stop" and g["raw_text"].endswith(stop) for g in lm.generations)


def test_sampling_and_unknown_generation_arguments_are_refused(default_base):
    from lm_eval import simple_evaluate

    from mars.evaluation.lm_eval_model import MarsLM

    ckpt, _ = default_base
    lm = MarsLM(str(ckpt), batch_size=4, device="cpu")
    for gen_kwargs, message in (({"do_sample": True, "temperature": 0.7}, "greedily"),
                                ({"repetition_penalty": 1.2}, "repetition_penalty")):
        with pytest.raises(MarsError, match=message):
            simple_evaluate(model=lm, tasks=["mars_heldout"], task_manager=local_manager(), limit=2,
                            gen_kwargs=gen_kwargs)
    with pytest.raises(MarsError, match="unknown for the mars model: revision"):
        MarsLM(str(ckpt), revision="main")
    with pytest.raises(ConfigError, match="tau"):
        MarsLM(str(ckpt), tau=1.5)
    with pytest.raises(ConfigError, match="--model_args.tree: expected a tree shape"):
        MarsLM(str(ckpt), mode="lossless", tree="top-2")


@pytest.mark.slow
def test_a_hub_task_offline_fails_in_one_line_before_any_model_loads(tmp_path):
    """The checkpoint does not even exist: the data check comes first, and says what is missing."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf")}
    missing = tmp_path / "no-checkpoint"
    runs = {
        "mars lm-eval": [sys.executable, "-m", "mars.cli", "lm-eval", "--model", "mars", "--model_args",
                         f"pretrained={missing}", "--tasks", "mars_heldout,gsm8k_cot"],
        "mars evaluate": [sys.executable, "-m", "mars.cli", "evaluate", "--checkpoint", f"mars={missing}",
                          "-S", "evaluate.lm_eval.tasks=[gsm8k_cot]", "-S", "evaluate.benchmarks.heldout.enabled=false",
                          "--out", str(tmp_path / "e"),
                          "--metrics", str(tmp_path / "m.json")],
    }
    for verb, cmd in runs.items():
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
        assert proc.returncode == 1, (verb, proc.stderr[-2000:])
        last = proc.stderr.strip().splitlines()[-1]
        assert last.startswith(f"{verb}: error: lm-eval task gsm8k_cot: its data set openai/gsm8k/main needs the "
                               "Hugging Face hub"), (verb, last)
        assert "mars_heldout" in last  # the way to run offline
        assert "no-checkpoint" not in proc.stderr


def test_names_resolve_to_leaf_tasks_and_unknown_ones_are_named():
    manager = local_manager()
    assert harness.resolve(["mars_heldout", "mars_gsm"], manager) == {"mars_heldout": ["mars_heldout"],
                                                                       "mars_gsm": ["mars_gsm"]}
    with pytest.raises(MarsError, match="lm-eval task 'gsm8k_typo': unknown"):
        harness.resolve(["gsm8k_typo"], manager)
    assert harness.check_tasks(["mars_heldout"], manager) == {"mars_heldout": ["mars_heldout"]}


def test_local_tasks_alone_skip_indexing_lm_evals_own():
    """mars_heldout and mars_gsm need none of lm-eval's ~15,000 tasks (a name that is not a local task
    takes the whole index: the hub task test below asks for gsm8k_cot)."""
    local = harness.task_manager(names=["mars_heldout", "mars_gsm"])
    assert {"mars_heldout", "mars_gsm"} <= set(local.task_index) and len(local.task_index) < 10


@pytest.mark.parametrize("over,message", [
    ({"tasks": ["ifeval", "ifeval"]}, "tasks: duplicate"),
    ({"limit": 0}, "limit"),
    ({"apply_chat_template": False}, "fewshot_as_multiturn: needs apply_chat_template"),
    ({"metrics": {"gsm8k_cot": "exact_match"}}, "metrics.gsm8k_cot: expected 'metric,filter'"),
])
def test_bad_lm_eval_params_name_the_key(over, message):
    with pytest.raises(ConfigError, match=message):
        build(LmEvalConfig, over, "evaluate.lm_eval")


def test_the_score_is_the_tasks_first_metric_unless_params_name_one():
    result = {"alias": "gsm8k_cot", "exact_match,strict-match": 0.25, "exact_match_stderr,strict-match": 0.01,
              "exact_match,flexible-extract": 0.5, "exact_match_stderr,flexible-extract": 0.02}
    assert harness.primary_metric("gsm8k_cot", result, None) == "exact_match,strict-match"
    assert harness.primary_metric("gsm8k_cot", result, "exact_match,flexible-extract") == "exact_match,flexible-extract"
    with pytest.raises(ConfigError, match="evaluate.lm_eval.metrics.gsm8k_cot: 'acc,none' is not among"):
        harness.primary_metric("gsm8k_cot", result, "acc,none")
