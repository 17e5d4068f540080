"""mars evaluate: metrics per checkpoint x benchmark x tau, traceable to the saved generations."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from mars.evaluation import benchmarks

from mars.cli import evaluate as evaluate_cli
from mars.evaluation import evaluate
from mars.evaluation.benchmarks import Benchmark, BenchmarkConfig, Item
from mars.errors import ConfigError
from mars.evaluation.evaluate import EvalConfig, read_jsonl

WORDS = 20
ANSWER_LEN = 6


def toy_tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {t: i for i, t in enumerate(["<pad>", "<eos>", "<|mask|>", "="] + [f"w{i}" for i in range(WORDS)])}
    tk = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tk.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tk, pad_token="<pad>", eos_token="<eos>")


def toy_answer(k: int) -> str:
    """The toy task: after "wK =" count on, modulo the word count."""
    return " ".join(f"w{(k + j) % WORDS}" for j in range(1, ANSWER_LEN + 1))


def make_checkpoint(path: Path, *, trained: bool = True, stage: str = "ar_control", block_size: int = 4,
                    seed: int = 0) -> Path:
    """A tiny Llama trained with the plain AR loss on the toy task (``trained=False``: random weights),
    saved as a MARS-contract checkpoint (config.mars + tokenizer with the mask token)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    tok = toy_tokenizer()
    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64,
                                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                         max_position_embeddings=64, eos_token_id=tok.eos_token_id,
                                         pad_token_id=tok.pad_token_id))
    if trained:
        threads = torch.get_num_threads()
        torch.set_num_threads(1)  # tiny matrices: extra threads only contend on a shared machine
        x = torch.tensor([tok(f"w{k} = {toy_answer(k)} <eos>")["input_ids"] for k in range(WORDS)])
        labels = x.clone()
        labels[:, :2] = -100
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        for _ in range(200):
            loss = model(input_ids=x, labels=labels).loss
            opt.zero_grad()
            loss.backward()
            opt.step()
        torch.set_num_threads(threads)
    model.config.mars = {"block_size": block_size, "mask_token_id": tok.convert_tokens_to_ids("<|mask|>"),
                         "objective": "ar" if stage != "mars" else "mars", "w_ar": 1.0, "stage": stage,
                         "block_offset": "fixed", "base": "toy"}
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path


@benchmarks.register
class Toy(Benchmark):
    """The toy counting task as a benchmark: token-id prompts, exact match."""

    kind = "toy"

    def items(self) -> list[Item]:
        tok = toy_tokenizer()
        pool = [Item(f"toy-{k}", tok(f"w{k} =")["input_ids"], toy_answer(k)) for k in range(WORDS)]
        return self.sample(pool)

    def score_one(self, item: Item, completion: str) -> float:
        return float(completion.strip() == item.reference)


@pytest.fixture(scope="module")
def ar_checkpoint(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("ckpt") / "ar")


def toy_config(**over) -> EvalConfig:
    kw = dict(taus=[1.0, 0.8], batch_size=8, benchmarks={"toy": BenchmarkConfig(n=12, max_new_tokens=ANSWER_LEN + 1)})
    kw.update(over)
    return EvalConfig(**kw)


def test_metrics_trace_back_to_the_saved_generations(ar_checkpoint, tmp_path):
    train_tsv = tmp_path / "metrics" / "train_sft.tsv"
    train_tsv.parent.mkdir()
    train_tsv.write_text("step\tloss\tl_mask\tl_ar\tlr\ttokens_per_s\n1\t3.0\t\t3.0\t0.001\t100\n2\t2.5\t\t2.5\t0.001\t110\n")
    metrics = evaluate.run({"ar_control": str(ar_checkpoint)}, toy_config(), data_dir=None, out_dir=tmp_path / "eval",
                           metrics_path=tmp_path / "metrics" / "eval.json", train_metrics_dir=tmp_path / "metrics",
                           log=lambda *_: None)
    on_disk = json.loads((tmp_path / "metrics" / "eval.json").read_text())
    assert on_disk == metrics
    assert sorted(on_disk) == ["ar_control/toy/lossless", "ar_control/toy/tau=0.8", "ar_control/toy/tau=1.0"]
    for key, entry in on_disk.items():
        ckpt, bench, tau = key.split("/")
        rows = read_jsonl(tmp_path / "eval" / ckpt / bench / f"{tau}.jsonl")
        assert len(rows) == entry["n"] == 12
        tokens = sum(len(r["token_ids"]) for r in rows)
        forwards = sum(r["forwards"] for r in rows)
        assert entry["tokens"] == tokens and entry["forwards"] == forwards
        assert entry["tokens_per_forward"] == pytest.approx(tokens / forwards)
        assert entry["score"] == pytest.approx(sum(r["score"] for r in rows) / len(rows))
        assert {"seconds", "tokens_per_s", "block_size", "tau", "mode"} <= set(entry)
    # tau = 1.0 is plain greedy AR: one token per forward, and the trained model solves the task.
    assert on_disk["ar_control/toy/tau=1.0"]["tokens_per_forward"] == 1.0
    assert on_disk["ar_control/toy/tau=1.0"]["score"] == 1.0
    # lossless: the tau = 1.0 generations exactly, one more point (tau null) after the sweep
    lossless = on_disk["ar_control/toy/lossless"]
    assert lossless["mode"] == "lossless" and lossless["tau"] is None and lossless["score"] == 1.0
    assert [r["token_ids"] for r in read_jsonl(tmp_path / "eval" / "ar_control" / "toy" / "lossless.jsonl")] == \
        [r["token_ids"] for r in read_jsonl(tmp_path / "eval" / "ar_control" / "toy" / "tau=1.0.jsonl")]
    plot_rows = json.loads((tmp_path / "eval" / "plots" / "toy" / "ar_control.json").read_text())
    assert [(r["tau"], r["mode"]) for r in plot_rows] == [(1.0, "tau"), (0.8, "tau"), (None, "lossless")]
    assert (tmp_path / "eval" / "figures" / "toy.png").stat().st_size > 1000
    assert (tmp_path / "eval" / "figures" / "training.png").stat().st_size > 1000
    report = (tmp_path / "eval" / "report.md").read_text()
    assert "## toy" in report and "figures/toy.png" in report and "figures/training.png" in report
    assert "| ar_control | lossless | 100.0 |" in report


def test_in_fp32_tau_one_is_the_lossless_decode_and_equals_decoding_it_apart(ar_checkpoint, tmp_path):
    run = lambda out, **over: evaluate.run({"ar_control": str(ar_checkpoint)}, toy_config(taus=[1.0], **over),  # noqa: E731
                                           data_dir=None, out_dir=tmp_path / out, metrics_path=tmp_path / f"{out}.json",
                                           train_metrics_dir=None, log=lambda *_: None)
    both, apart = run("both"), run("apart", lossless=False)
    assert both["ar_control/toy/tau=1.0"]["derived_from"] == "lossless" and "derived_from" not in apart["ar_control/toy/tau=1.0"]
    derived = read_jsonl(tmp_path / "both" / "ar_control" / "toy" / "tau=1.0.jsonl")
    decoded = read_jsonl(tmp_path / "apart" / "ar_control" / "toy" / "tau=1.0.jsonl")
    for key in ("id", "token_ids", "text", "forwards", "score", "finish_reason"):
        assert [r[key] for r in derived] == [r[key] for r in decoded], key
    same = ("score", "tokens", "forwards", "tokens_per_forward", "n")
    assert {k: both["ar_control/toy/tau=1.0"][k] for k in same} == {k: apart["ar_control/toy/tau=1.0"][k] for k in same}
    assert "| ar_control | 1 | 100.0 | 1.00 |" in (tmp_path / "both" / "report.md").read_text()


def test_the_lossless_entries_may_verify_draft_trees(ar_checkpoint, tmp_path):
    run = lambda out, **over: evaluate.run({"ar_control": str(ar_checkpoint)}, toy_config(taus=[1.0], **over),  # noqa: E731
                                           data_dir=None, out_dir=tmp_path / out, metrics_path=tmp_path / f"{out}.json",
                                           train_metrics_dir=None, log=lambda *_: None)
    chain, tree, auto = run("chain"), run("tree", tree="top2/6"), run("auto", tree="auto")
    assert tree["ar_control/toy/lossless"]["tree"] == "top2/6" and "tree" not in chain["ar_control/toy/lossless"]
    assert auto["ar_control/toy/lossless"]["tree"] == "auto"
    for out in ("chain", "tree", "auto"):  # the same greedy tokens, whatever the drafts
        assert [r["token_ids"] for r in read_jsonl(tmp_path / out / "ar_control" / "toy" / "lossless.jsonl")] == \
            [r["token_ids"] for r in read_jsonl(tmp_path / "chain" / "ar_control" / "toy" / "tau=1.0.jsonl")]
    with pytest.raises(ConfigError, match="tree: expected a tree shape"):
        toy_config(tree="top-2")


def test_the_tau_sweep_may_decode_a_seeded_subset(ar_checkpoint, tmp_path):
    metrics = evaluate.run({"ar_control": str(ar_checkpoint), "again": str(ar_checkpoint)},
                           toy_config(taus=[1.0, 0.8], sweep_n=5), data_dir=None, out_dir=tmp_path / "eval",
                           metrics_path=tmp_path / "eval.json", train_metrics_dir=None, log=lambda *_: None)
    assert [metrics[f"ar_control/toy/{t}"]["n"] for t in ("tau=1.0", "tau=0.8", "lossless")] == [12, 5, 12]
    subset = [[r["id"] for r in read_jsonl(tmp_path / "eval" / c / "toy" / "tau=0.8.jsonl")] for c in ("ar_control", "again")]
    everything = [r["id"] for r in read_jsonl(tmp_path / "eval" / "ar_control" / "toy" / "tau=1.0.jsonl")]
    assert subset[0] == subset[1] and set(subset[0]) < set(everything)  # the same items for every checkpoint
    assert subset[0] == [i for i in everything if i in subset[0]]  # in benchmark order
    with pytest.raises(ConfigError, match="sweep_n: must be >= 1"):
        toy_config(sweep_n=0)


def test_a_benchmark_may_sweep_fewer_items_than_the_others(ar_checkpoint, tmp_path):
    benches = {"toy": BenchmarkConfig(n=8, max_new_tokens=ANSWER_LEN + 1),
               "reported": BenchmarkConfig(kind="toy", n=8, max_new_tokens=ANSWER_LEN + 1, sweep_n=3)}
    metrics = evaluate.run({"mars": str(ar_checkpoint)}, toy_config(taus=[1.0, 0.8], benchmarks=benches, sweep_n=6),
                           data_dir=None, out_dir=tmp_path / "eval", metrics_path=tmp_path / "eval.json",
                           train_metrics_dir=None, log=lambda *_: None)
    assert {k: e["n"] for k, e in metrics.items()} == {
        "mars/toy/tau=1.0": 8, "mars/toy/tau=0.8": 6, "mars/toy/lossless": 8,
        "mars/reported/tau=1.0": 8, "mars/reported/tau=0.8": 3, "mars/reported/lossless": 8}
    with pytest.raises(ConfigError, match="sweep_n: must be >= 1"):
        BenchmarkConfig(sweep_n=0)


def test_agreement_with_the_reference_is_measured_on_the_items_every_tau_decodes(ar_checkpoint, tmp_path):
    other = make_checkpoint(tmp_path / "other", seed=1, trained=False)
    metrics = evaluate.run({"sft": str(ar_checkpoint), "other": str(other)},
                           toy_config(taus=[1.0, 0.8], sweep_n=5, reference="sft"), data_dir=None,
                           out_dir=tmp_path / "eval", metrics_path=tmp_path / "eval.json", train_metrics_dir=None,
                           log=lambda *_: None)
    swept = {r["id"] for r in read_jsonl(tmp_path / "eval" / "sft" / "toy" / "tau=0.8.jsonl")}
    for key, entry in metrics.items():
        rows = read_jsonl(tmp_path / "eval" / f"{key}.jsonl")
        assert entry["agreement_n"] == 5 and {r["id"] for r in rows if "agree_exact" in r} == swept, key
        measured = [r for r in rows if r["id"] in swept]
        assert entry["ref_logprob"] == pytest.approx(sum(r["ref_logprob_sum"] for r in measured)
                                                     / sum(len(r["token_ids"]) for r in measured))
    assert metrics["sft/toy/tau=1.0"]["agree_exact"] == 1.0  # the reference against itself
    assert metrics["other/toy/tau=1.0"]["agree_exact"] == 0.0  # random weights: never the trained answer
    # the tau = 1.0 twin of the lossless output: the same measures
    assert {k: v for k, v in metrics["sft/toy/tau=1.0"].items() if k.startswith(("agree", "ref_"))} == \
        {k: v for k, v in metrics["sft/toy/lossless"].items() if k.startswith(("agree", "ref_"))}


def test_an_interrupted_evaluation_resumes_from_its_finished_decodings(ar_checkpoint, tmp_path, monkeypatch):
    import mars.decoding.generate as generate_module

    decoded = []
    real = generate_module.generate
    monkeypatch.setattr(generate_module, "generate", lambda *a, **kw: decoded.append(kw["tau"]) or real(*a, **kw))
    run = lambda out, **over: evaluate.run({"ar_control": str(ar_checkpoint)}, toy_config(**over),  # noqa: E731
                                           data_dir=None, out_dir=tmp_path / out, metrics_path=tmp_path / f"{out}.json",
                                           train_metrics_dir=None, log=lambda *_: None, work=tmp_path / "work")
    first = run("first")
    assert len(decoded) == 2  # lossless (tau = 1.0 taken from it) and 0.8
    decoded.clear()
    again = run("again")
    assert decoded == [] and {k for k, e in again.items() if e.pop("reused", False)} == \
        {"ar_control/toy/lossless", "ar_control/toy/tau=0.8"}
    assert again == first  # seconds included: the decoding's own, not the reuse's
    for point in ("tau=1.0", "tau=0.8", "lossless"):
        assert read_jsonl(tmp_path / "again" / "ar_control" / "toy" / f"{point}.jsonl") == \
            read_jsonl(tmp_path / "first" / "ar_control" / "toy" / f"{point}.jsonl")
    # killed after writing the rows of tau = 0.8 but before its record: that one decodes again
    (tmp_path / "work" / "ar_control" / "toy" / "tau=0.8.json").unlink()
    run("killed")
    assert decoded == [0.8]
    decoded.clear()
    longer = {"toy": BenchmarkConfig(n=12, max_new_tokens=ANSWER_LEN + 2)}  # another setting: decoded anew
    run("changed", benchmarks=longer)
    assert sorted(decoded) == [0.8, 1.0]
    decoded.clear()
    # a scorer changed since: the kept decodings are scored again, not their old scores taken
    monkeypatch.setattr(Toy, "score_one", lambda self, item, completion: 0.0)
    rescored = run("rescored", benchmarks=longer)
    assert decoded == [] and all(e["score"] == 0.0 for e in rescored.values())


def test_a_checkpoint_without_a_digest_is_never_taken_from_the_work_folder(tmp_path):
    from mars.evaluation.resume import Resume

    resume, key = Resume(tmp_path), evaluate.MetricKey("hub", "toy", 1.0)
    resume.put(key, {"checkpoint_sha256": None}, [{"id": "a"}], 1.0)
    assert resume.get(key, {"checkpoint_sha256": None}, ["a"]) is None and not any(tmp_path.iterdir())
    resume.put(key, {"checkpoint_sha256": "x"}, [{"id": "a"}], 1.0)
    assert resume.get(key, {"checkpoint_sha256": "x"}, ["a"]) == ([{"id": "a"}], 1.0)
    assert resume.get(key, {"checkpoint_sha256": "x"}, ["b"]) is None  # other items: not these rows


def test_the_cli_reads_params_and_checkpoints(ar_checkpoint, tmp_path):
    params = tmp_path / "params.yaml"
    params.write_text(
        "evaluate:\n  taus: [1.0]\n  lossless: false\n  benchmarks:\n    toy: {n: 3, max_new_tokens: 4}\n"
    )
    rc = evaluate_cli.main(["--params", str(params), "--checkpoint", f"sft={ar_checkpoint}", "--out", str(tmp_path / "e"),
                       "--metrics", str(tmp_path / "m.json"), "--train-metrics", str(tmp_path / "none")])
    assert rc == 0
    assert list(json.loads((tmp_path / "m.json").read_text())) == ["sft/toy/tau=1.0"]


def test_bad_arguments_and_config_are_named():
    with pytest.raises(ConfigError, match="NAME=DIR"):
        evaluate_cli.parse_checkpoints(["checkpoints/mars"])
    with pytest.raises(ConfigError, match="taus"):
        EvalConfig(taus=[1.5])
    with pytest.raises(ConfigError, match="none is enabled"):
        EvalConfig(benchmarks={"heldout": BenchmarkConfig(enabled=False)})
