"""`mars export` and the onnxruntime engine: the exported block forward behaves as the PyTorch one."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import periodic, tiny_model, train_to_draft
from mars.core.checkpoint_info import CheckpointInfoError
from mars.core.digest import sha256_file
from mars.decoding.onnx_backend import EngineError, ExportedBlock, read_manifest, window_mask
from mars.errors import ConfigError, MarsError
from mars.release.export import (ExportConfig, ExportError, block_forward, block_spec, example_inputs, export_checkpoint)

BLOCK = 4
LAYERS = 4  # of SmolLM2's 30, in its export test
CFG = dict(batch_size=2, window=8, max_context=160, latency_iters=2)


def tiny_tokenizer():
    """A byte-level BPE tokenizer of 90 tokens (tiny_model has 96 rows) trained on the built-in suite."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from mars.training import suite
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    text = [f"{item.prompt} {item.response}" for item in suite.train(200, seed=0)]
    tok.train_from_iterator(text, trainers.BpeTrainer(vocab_size=90, special_tokens=["<unk>", "<eos>"]))
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="<eos>")
    hf.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    return hf


def make_mars_checkpoint(path: Path, arch: str = "llama", *, mars: bool = True, tokenizer: bool = True,
                         confidence: float = 200.0, drafting: bool = False) -> Path:
    """A MARS checkpoint as `mars train` writes it (random tiny weights), or a broken variant.

    The LM head is scaled by ``confidence`` so that the random model is sure of some slots and not of
    others: at tau = 0.9 rows accept 1 to ~2.7 tokens per forward, so decoding exercises ragged acceptance.
    ``drafting``: trained on repeated phrases instead (conftest.train_to_draft), so lossless drafts verify.
    """
    from mars.core.mask_token import add_mask_token

    model, tok = tiny_model(arch), tiny_tokenizer()
    info = add_mask_token(model, tok)
    if drafting:
        train_to_draft(model, info.token_id, block_size=BLOCK)
    else:
        with torch.no_grad():
            model.lm_head.weight.mul_(confidence)
    if mars:
        model.config.mars = {"block_size": BLOCK, "mask_token_id": info.token_id, "objective": "mars",
                             "w_ar": 1.0, "stage": "mars", "block_offset": "fixed", "base": "test"}
    model.save_pretrained(path)
    if tokenizer:
        tok.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return make_mars_checkpoint(tmp_path_factory.mktemp("ckpt") / "mars")


@pytest.fixture(scope="module")
def exported(checkpoint, tmp_path_factory):
    out = tmp_path_factory.mktemp("exports") / "mars"
    manifest = export_checkpoint(checkpoint, out, ExportConfig(**CFG), log=lambda *_: None)
    return out, manifest


# -- the block forward itself ------------------------------------------------------------------------


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_block_forward_equals_a_plain_causal_forward(arch):
    """Window logits against a ragged prefix cache are the logits of one causal pass over prefix + window."""
    from transformers import DynamicCache

    model = tiny_model(arch)
    spec = block_spec(model.config, batch_size=2, window=5, max_context=32)
    module = block_forward(model)
    lens, seqs = [7, 3], [torch.randint(0, 96, (n + 5,)) for n in (7, 3)]
    past = max(lens)
    keys, values = torch.zeros(spec.cache_shape(past)), torch.zeros(spec.cache_shape(past))
    for r, (n, seq) in enumerate(zip(lens, seqs)):
        cache = DynamicCache()
        with torch.no_grad():
            model(input_ids=seq[None, :n], position_ids=torch.arange(n)[None], cache=cache, use_cache=True)
        keys[:, r, :, :n] = torch.stack([layer.keys[0] for layer in cache.layers])
        values[:, r, :, :n] = torch.stack([layer.values[0] for layer in cache.layers])
        keys[:, r, :, n:] = 1e3  # junk beyond the row's prefix: the mask must hide it
    ids = torch.stack([seq[n:] for n, seq in zip(lens, seqs)])
    positions = torch.tensor(lens)[:, None] + torch.arange(5)[None]
    mask = torch.from_numpy(window_mask(lens, past, 5))
    with torch.no_grad():
        logits, new_keys, _ = module(ids, positions, mask, keys, values)
        for r, (n, seq) in enumerate(zip(lens, seqs)):
            full = model(input_ids=seq[None], position_ids=torch.arange(len(seq))[None]).logits[0, n:]
            torch.testing.assert_close(logits[r], full, atol=1e-5, rtol=1e-4)
    assert new_keys.shape == (spec.num_layers, 2, spec.kv_heads, 5, spec.head_dim)


def test_window_mask_rows_see_their_prefix_and_the_causal_window():
    mask = window_mask([2, 0], past=3, window=2)
    seen = mask == 0
    assert mask.shape == (2, 1, 2, 5) and mask.dtype == np.float32
    assert seen[0, 0].tolist() == [[True, True, False, True, False], [True, True, False, True, True]]
    assert seen[1, 0].tolist() == [[False, False, False, True, False], [False, False, False, True, True]]
    half = window_mask([2, 0], past=3, window=2, dtype=np.float16)
    assert half.dtype == np.float16 and np.array_equal(half == 0, seen)
    assert (half[~seen] == np.finfo(np.float16).min).all()
    with pytest.raises(EngineError, match="prefix lengths"):
        window_mask([4], past=3, window=2)


# -- the export directory ----------------------------------------------------------------------------


def test_export_dir_is_self_contained_and_checksummed(exported, checkpoint):
    from transformers import AutoConfig, AutoTokenizer

    out, manifest = exported
    names = {p.name for p in out.iterdir()}
    assert {"model.onnx", "config.json", "manifest.json", "tokenizer.json", "tokenizer_config.json"} <= names
    assert set(manifest["files"]) == names - {"manifest.json"}
    assert all(sha256_file(out / n) == digest for n, digest in manifest["files"].items())
    assert manifest["onnx"] == manifest["onnx"] | {"file": "model.onnx", "files": ["model.onnx"], "opset": 18,
                                                   "external_data": False}
    assert manifest["block"]["batch_size"] == 2 and manifest["block"]["window"] == 8
    assert manifest["past_axis"] == {"kind": "dynamic", "min": 0, "max": 152}
    assert manifest["inputs"]["past_keys"]["shape"] == [2, 2, 2, "past", 8]
    assert manifest["outputs"]["logits"]["shape"] == [2, 8, 96]
    assert set(manifest["onnx"]["parity"]["prefix_lengths"]) == {"0", "1", "76", "152"}
    assert manifest["onnx"]["parity"]["max_abs_logits"] <= 1e-4
    assert len(manifest["checkpoint"]["sha256"]) == 64
    # A downstream service decodes from the export dir alone: tokenizer + config with config.mars.
    assert AutoConfig.from_pretrained(out).mars["mask_token_id"] == manifest["mars"]["mask_token_id"]
    tok = AutoTokenizer.from_pretrained(out)
    assert tok.convert_ids_to_tokens(manifest["mars"]["mask_token_id"]) == "<|mask|>"
    assert set(manifest["tokenizer_files"]) <= names


def test_tensorrt_is_recorded_as_it_happened(exported):
    out, manifest = exported
    trt = manifest["tensorrt"]
    if trt["status"] == "built":  # only on a CUDA machine with torch-tensorrt
        assert (out / trt["file"]).is_file() and trt["file"] in manifest["files"]
    else:
        assert trt["status"] == "unavailable" and trt["reason"]
        assert not any(p.suffix in {".ep", ".engine"} for p in out.iterdir())
        if not torch.cuda.is_available():
            assert trt["reason"] == "no CUDA device"


def test_onnxruntime_matches_pytorch_at_prefix_lengths_0_to_max(exported, checkpoint):
    from mars.core.models import load_model

    out, _ = exported
    engine = ExportedBlock(out)
    model, _ = load_model(checkpoint)
    module, spec = block_forward(model), engine.spec
    generator = torch.Generator().manual_seed(7)
    for lens in ([0, 0], [1, 0], [30, 17], [spec.max_prefix, spec.max_prefix - 5]):
        args = example_inputs(spec, lens, max(lens), generator=generator)
        with torch.no_grad():
            ref = module(*args)
        got = engine(*(a.numpy() for a in args))
        for g, r in zip(got, ref):
            assert g.shape == tuple(r.shape)
            assert np.abs(g - r.numpy()).max() <= 1e-4, lens


def test_corrupt_export_is_refused(exported, tmp_path):
    import shutil

    out, _ = exported
    copy = tmp_path / "copy"
    shutil.copytree(out, copy)
    with open(copy / "tokenizer.json", "a") as fh:
        fh.write(" ")
    with pytest.raises(EngineError, match="tokenizer.json does not match its sha256"):
        read_manifest(copy)


@pytest.mark.parametrize("text, message", [("[" * 100_000, r"not valid JSON \(nested too deeply\)"),
                                           ("[1, 2]", r"not an export manifest \(no 'files' object\)")])
def test_an_unreadable_export_manifest_is_one_line_naming_it(tmp_path, text, message):
    (tmp_path / "manifest.json").write_text(text)
    with pytest.raises(EngineError, match=rf"{tmp_path / 'manifest.json'}: {message}"):
        read_manifest(tmp_path)


def test_external_data_is_written_and_said_in_the_manifest(checkpoint, exported, tmp_path):
    manifest = export_checkpoint(checkpoint, tmp_path / "ext", ExportConfig(**CFG, external_data=True, tensorrt=False),
                                 log=lambda *_: None)
    assert manifest["onnx"]["external_data"] is True
    assert manifest["onnx"]["files"] == ["model.onnx", "model.onnx.data"]
    assert "model.onnx.data" in manifest["files"] and manifest["tensorrt"]["status"] == "skipped"
    single = (exported[0] / "model.onnx").stat().st_size
    assert (tmp_path / "ext" / "model.onnx").stat().st_size < single  # the weights went to the data file
    ExportedBlock(tmp_path / "ext")  # loads with its weights beside it


# -- decoding on the engine --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def heldout_prompts():
    from mars.training import suite
    return [item.prompt for item in suite.heldout(5, seed=0)]


@pytest.mark.parametrize("tau", [1.0, 0.9])
@pytest.mark.parametrize("b_cache", [None, 6], ids=["token-cache", "block-cache"])
def test_onnxruntime_decoder_gives_the_pytorch_decoders_tokens(exported, checkpoint, heldout_prompts, tau, b_cache):
    """generate() on the exported graph: same tokens and forwards as on the PyTorch model.

    The export's batch is 2 and W = 8: five prompts run as three batches (the last one with a padding
    row), rows finish at different steps (retain), and the block cache's windows (C + B - 1 = 9) are
    wider than W (two graph calls)."""
    from mars.decoding.generate import generate
    from mars.core.models import load_model

    engine = ExportedBlock(exported[0])
    model, tok = load_model(checkpoint)
    ref = generate(model, tok, heldout_prompts, tau=tau, max_new_tokens=16, batch_size=2, b_cache=b_cache)
    got = engine.generate(heldout_prompts, tau=tau, max_new_tokens=16, b_cache=b_cache)
    assert [r.token_ids for r in got] == [r.token_ids for r in ref]
    assert [r.forwards for r in got] == [r.forwards for r in ref]
    assert [r.text for r in got] == [r.text for r in ref]
    if tau < 1.0:
        assert ref.tokens_per_forward > 1.2  # several tokens per forward were accepted, unevenly
    else:
        assert got.tokens_per_forward == 1.0


@pytest.fixture(scope="module")
def drafting_export(tmp_path_factory):
    checkpoint = make_mars_checkpoint(tmp_path_factory.mktemp("ckpt") / "drafting", drafting=True)
    out = tmp_path_factory.mktemp("exports") / "drafting"
    export_checkpoint(checkpoint, out, ExportConfig(**CFG), log=lambda *_: None)
    return checkpoint, out


@pytest.mark.parametrize("b_cache", [None, 6], ids=["token-cache", "block-cache"])
def test_onnxruntime_decoder_runs_lossless_mode_exactly(drafting_export, heldout_prompts, b_cache):
    """Lossless mode on the exported graph: greedy output, the PyTorch decoder's forwards. Its windows
    (the last token + up to B-1 drafts + B-1 masks: 7) fit W = 8; the block cache's are wider (two calls)."""
    from mars.decoding.generate import generate
    from mars.core.models import load_model

    checkpoint, out = drafting_export
    model, tok = load_model(checkpoint)
    prompts = [x[:n] for x, n in zip(periodic(3, 12, seed=8), (7, 9, 8))] + heldout_prompts[:2]  # no <eos> in them
    greedy = generate(model, tok, prompts, tau=1.0, max_new_tokens=16, batch_size=2)
    ref = generate(model, tok, prompts, mode="lossless", max_new_tokens=16, batch_size=2, b_cache=b_cache)
    got = ExportedBlock(out).generate(prompts, mode="lossless", max_new_tokens=16, b_cache=b_cache)
    assert [r.token_ids for r in got] == [r.token_ids for r in ref] == [r.token_ids for r in greedy]
    assert [r.forwards for r in got] == [r.forwards for r in ref]
    assert ref.tokens_per_forward > 2  # the repeated phrases' drafts verify: several tokens per forward


def test_committing_a_tree_path_moves_each_layers_and_heads_entries_up_in_place():
    """commit(n, keep) keeps window entries keep[r, :n[r]] of row r, moved up behind its committed ones, every
    layer and head in its own place (layers, heads and path length all differ here, so a transposed copy fails)."""
    from types import SimpleNamespace

    from mars.decoding.onnx_backend import BlockSpec, OnnxBackend

    spec = BlockSpec(batch_size=2, window=8, max_context=24, num_layers=2, kv_heads=3, head_dim=4, vocab_size=10)
    engine = SimpleNamespace(spec=spec, mask_token_id=9, manifest={"inputs": {"past_keys": {"dtype": "float32"}}})
    backend = OnnxBackend(engine)
    backend.extend(2)
    backend.keys[:] = np.arange(backend.keys.size, dtype=np.float32).reshape(backend.keys.shape)
    backend.values[:] = -backend.keys
    backend.lens[:2] = [5, 3]
    before_k, before_v = backend.keys.copy(), backend.values.copy()

    backend.commit(np.array([4, 2]), np.array([[0, 2, 5, 6, 7], [0, 1, 2, 3, 4]]))

    assert backend.lens[:2].tolist() == [9, 5]
    np.testing.assert_array_equal(backend.keys[:, 0, :, 5:9], before_k[:, 0, :, [5, 7, 10, 11]].transpose(1, 2, 0, 3))
    np.testing.assert_array_equal(backend.values[:, 0, :, 5:9], before_v[:, 0, :, [5, 7, 10, 11]].transpose(1, 2, 0, 3))
    np.testing.assert_array_equal(backend.keys[:, 0, :, :5], before_k[:, 0, :, :5])
    np.testing.assert_array_equal(backend.keys[:, 1], before_k[:, 1])  # row 1's path is its first entries: no move


@pytest.mark.parametrize("b_cache", [None, 6], ids=["token-cache", "block-cache"])
def test_onnxruntime_decoder_verifies_draft_trees_as_the_pytorch_decoder(drafting_export, heldout_prompts, b_cache):
    """Tree windows (up to 1 + 6 + 7 x 3 = 28 entries here) run as chunks of W = 8, each seeing the entries
    of the chunks before it that the tree lets it see; an accepted path's K/V move up in the cache."""
    from mars.decoding.generate import generate
    from mars.core.models import load_model

    checkpoint, out = drafting_export
    model, tok = load_model(checkpoint)
    prompts = [x[:n] for x, n in zip(periodic(3, 12, seed=8), (7, 9, 8))] + heldout_prompts[:2]
    greedy = generate(model, tok, prompts, tau=1.0, max_new_tokens=16, batch_size=2)
    for tree in ("top2/6", "(3,1)/5+masks:2"):
        ref = generate(model, tok, prompts, mode="lossless", tree=tree, max_new_tokens=16, batch_size=2, b_cache=b_cache)
        got = ExportedBlock(out).generate(prompts, mode="lossless", tree=tree, max_new_tokens=16, b_cache=b_cache)
        assert [r.token_ids for r in got] == [r.token_ids for r in ref] == [r.token_ids for r in greedy], tree
        assert [r.forwards for r in got] == [r.forwards for r in ref], tree


def test_a_window_mask_may_carry_a_trees_attention_across_chunks():
    tree = np.array([[[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [0, 0, 1, 1]]], dtype=bool)  # [1, 4, 4]
    first = window_mask([3], past=3, window=2, allowed=tree[:, :2, :2]) == 0
    assert first[0, 0].tolist() == [[True, True, True, True, False], [True, True, True, True, True]]
    # the second chunk: prefix keys 3..4 are the first chunk's entries, seen as the tree says
    second = window_mask([5], past=5, window=2, allowed=tree[:, 2:, :], pending=2) == 0
    assert second[0, 0].tolist() == [[True, True, True, True, False, True, False],
                                     [True, True, True, False, False, True, True]]


def test_engine_refuses_what_its_graph_cannot_hold(exported):
    engine = ExportedBlock(exported[0])
    with pytest.raises(EngineError, match="exceeds the export's batch of 2"):
        engine.generate(["x"], batch_size=3)
    # The export's context (max_context 160 - W 8 + 1) bounds prompt + generated tokens.
    with pytest.raises(MarsError, match="the model's context is 153"):
        engine.generate([[5] * 153], tau=0.9)


# -- bad input ---------------------------------------------------------------------------------------


def test_not_a_mars_checkpoint(tmp_path):
    plain = make_mars_checkpoint(tmp_path / "plain", mars=False)
    with pytest.raises(CheckpointInfoError, match="not a MARS checkpoint"):
        export_checkpoint(plain, tmp_path / "out", ExportConfig(**CFG))
    assert not (tmp_path / "out").exists()


def test_tokenizer_without_the_mask_token(tmp_path):
    ckpt = make_mars_checkpoint(tmp_path / "ckpt")
    config = json.loads((ckpt / "config.json").read_text())
    config["mars"]["mask_token_id"] = 40  # an ordinary BPE token
    (ckpt / "config.json").write_text(json.dumps(config))
    with pytest.raises(ExportError, match="mask_token_id 40 is '.*', not a special token"):
        export_checkpoint(ckpt, tmp_path / "out", ExportConfig(**CFG))


def test_the_stand_in_checkpoint_has_the_profiles_mars_block_size(tmp_path):
    """The export benchmarks' stand-in model records ``train.mars.block_size`` (it once read a
    nonexistent ``train.block_size`` and silently fell back to 4)."""
    from mars.cli.options import stand_in_from_params
    from mars.config import load_params
    from mars.core.checkpoint_info import CheckpointInfo

    small = ["model.tiny.hidden_size=32", "model.tiny.num_hidden_layers=1", "model.tiny.intermediate_size=64",
             "model.tiny.tokenizer_corpus=200", "model.tiny.vocab_size=300"]
    params = load_params(Path(__file__).parents[1] / "params.yaml", small + ["train.mars.block_size=8"])
    info = CheckpointInfo.read(stand_in_from_params(params, tmp_path / "stand_in"))
    assert info.block_size == 8 and info.base == "stand-in: random weights"


def test_missing_tokenizer(tmp_path):
    bare = make_mars_checkpoint(tmp_path / "bare", tokenizer=False)
    with pytest.raises(ExportError, match="no tokenizer files"):
        export_checkpoint(bare, tmp_path / "out", ExportConfig(**CFG))


def test_window_larger_than_the_context(checkpoint, tmp_path):
    with pytest.raises(ConfigError, match="window: W=80 is larger than max_context=64"):
        ExportConfig(batch_size=1, window=80, max_context=64)  # W must fit the context
    with pytest.raises(ConfigError, match="leaves 1 of max_context=64 for the prefix cache"):
        ExportConfig(batch_size=1, window=63, max_context=64)
    with pytest.raises(ConfigError, match="max_position_embeddings=256"):
        export_checkpoint(checkpoint, tmp_path / "out", ExportConfig(window=8, max_context=1024))
    with pytest.raises(ConfigError, match="smaller than the checkpoint's block size B=4"):
        export_checkpoint(checkpoint, tmp_path / "out", ExportConfig(window=2, max_context=160))


def test_failed_export_leaves_the_previous_one_untouched(checkpoint, exported, tmp_path):
    import shutil

    out = tmp_path / "mars"
    shutil.copytree(exported[0], out)
    before = (out / "manifest.json").read_bytes()
    # An impossible tolerance makes the parity check fail after the ONNX file was written.
    with pytest.raises(ExportError, match="parity check failed"):
        export_checkpoint(checkpoint, out, ExportConfig(**CFG | {"parity_atol": 1e-30}), log=lambda *_: None)
    assert (out / "manifest.json").read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mars"]  # no temp dir left behind


def test_cli(checkpoint, tmp_path, capsys):
    from mars.cli import main

    params = tmp_path / "params.yaml"
    params.write_text("export:\n  batch_size: 1\n  window: 4\n  max_context: 32\n  tensorrt: false\n")
    assert main(["export", "--params", str(params), "--checkpoint", str(checkpoint), "--out", str(tmp_path / "e")]) == 0
    assert json.loads((tmp_path / "e" / "manifest.json").read_text())["block"]["window"] == 4
    assert main(["export", "--params", str(params), "-S", "export.window=64", "--checkpoint", str(checkpoint),
                 "--out", str(tmp_path / "f")]) == 1
    assert "export.window: W=64 is larger than max_context=32" in capsys.readouterr().err
    assert not (tmp_path / "f").exists()


# -- a real model ------------------------------------------------------------------------------------


@pytest.mark.slow
def test_smollm2_exports_with_parity_and_decodes_alike(smollm2_dir, tmp_path):
    """SmolLM2's real weights, tokenizer and chat template, cut to a few layers."""
    from mars.decoding.generate import generate
    from mars.core.mask_token import add_mask_token
    from mars.core.models import load_model

    model, tok = load_model(smollm2_dir)
    # its first 4 of 30 layers: the graph repeats one layer, and tracing all 30 would triple the test's time
    model.model.layers = model.model.layers[:LAYERS]
    model.config.num_hidden_layers = LAYERS
    info = add_mask_token(model, tok)
    model.config.mars = {"block_size": BLOCK, "mask_token_id": info.token_id, "objective": "mars", "w_ar": 1.0,
                         "stage": "mars", "block_offset": "fixed", "base": "smollm2"}
    model.save_pretrained(tmp_path / "ckpt")
    tok.save_pretrained(tmp_path / "ckpt")
    manifest = export_checkpoint(tmp_path / "ckpt", tmp_path / "out",
                                 ExportConfig(batch_size=1, window=8, max_context=24, tensorrt=False),
                                 log=lambda *_: None)
    assert manifest["onnx"]["parity"]["max_abs_logits"] <= 1e-4
    assert manifest["block"]["num_layers"] == LAYERS and manifest["block"]["vocab_size"] == info.embedding_rows_after
    out = tmp_path / "out"
    assert "chat_template" in json.loads((out / "tokenizer_config.json").read_text()) or \
        (out / "chat_template.jinja").is_file()
    prompt = [tok("The capital of France is", add_special_tokens=False)["input_ids"]]
    for tau in (1.0, 0.9):
        ref = generate(model, tok, prompt, tau=tau, max_new_tokens=8, batch_size=1)
        got = ExportedBlock(out).generate(prompt, tau=tau, max_new_tokens=8)
        assert got[0].token_ids == ref[0].token_ids and got[0].forwards == ref[0].forwards
