"""mars serve: a real uvicorn on 127.0.0.1, a small release made here, driven with the official openai client.

The release is a tiny random Llama (confident enough that tau < 1 accepts several slots, its EOS never the
argmax so greedy requests run to their budget) with a real BPE tokenizer and chat template, promoted to a
directory store through mars.release.promote and pulled by the server as `mars serve --release` does.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest
import torch
from conftest import tiny_model
from gate_evidence import decide as gate_decide

from mars.core.digest import sha256_tree
from mars.decoding.batch import CachedBatch, DecodeRow
from mars.decoding.generate import encode_prompts, generate
from mars.decoding.sampling import Sampler, SamplingParams, filtered_probs
from mars.decoding.setting import Setting
from mars.decoding.torch_backend import TorchBackend
from mars.release.promote import promote
from mars.release.store import open_store
from mars.serving.config import ServeConfig
from mars.serving.served_model import chat_head
from mars.serving.server import build, make_server
from mars.decoding.tau_policy import PolicyConfig

B = 4
NAME = "mars"
PROMPTS = ["3 plus 4 is", "the cat sat on", "list three numbers", "what is 2 plus 2"]
TEXTS = [f"{a} plus {b} is {a + b}. the cat sat on the mat. list three numbers: 1 2 3." for a in range(30)
         for b in range(3)]


def quiet(*_args) -> None:
    pass


# ------------------------------------------------------------------------------------------- the release

def make_checkpoint(out: Path, seed: int, scale: float = 60.0) -> Path:
    from mars.core.mask_token import add_mask_token
    from mars.training.base import train_tokenizer

    tokenizer = train_tokenizer(TEXTS, vocab_size=300)
    model = tiny_model("llama", seed=seed, vocab=len(tokenizer) + 8)
    info = add_mask_token(model, tokenizer)
    with torch.no_grad():
        model.lm_head.weight.mul_(scale)
        model.lm_head.weight[tokenizer.eos_token_id] = 0  # logit 0: never the argmax among ~300 spread ones
    model.config.mars = {"block_size": B, "mask_token_id": info.token_id, "objective": "mars", "stage": "mars"}
    model.config.eos_token_id, model.config.pad_token_id = tokenizer.eos_token_id, tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def publish(root: Path, store_uri: str, seed: int, *, broken: bool = False, speed_tau: float = 0.5,
            onnx: bool = False) -> None:
    """Promote a tiny checkpoint to stage prod, with a real ONNX export (``onnx``) or a stand-in one (the
    torch backend does not read it)."""
    ckpt = make_checkpoint(root / "checkpoint", seed)
    if broken:  # a release whose weights do not load: the server must keep the old one
        (ckpt / "model.safetensors").write_bytes(b"not a safetensors file")
    export = root / "export"
    if onnx:
        from mars.release.export import ExportConfig, export_checkpoint

        export_checkpoint(ckpt, export, ExportConfig(batch_size=4, window=8, max_context=96, tensorrt=False,
                                                     latency_iters=1), log=quiet)
    else:
        export.mkdir(parents=True)
        mars = json.loads((ckpt / "config.json").read_text())["mars"]
        (export / "manifest.json").write_text(json.dumps({"format_version": 1, "mars": mars,
                                                          "checkpoint": {"sha256": sha256_tree(ckpt)}}))
    # a real decision that passed, with its score check at speed_tau: the release's tau floor
    gate = gate_decide(root / "gate", ckpt, export, speed_tau=speed_tau)
    assert [c["passed"] for c in json.loads(gate.read_text())["checks"] if c["name"] == "score_at_speed_tau"] == [True]
    promote(open_store(store_uri), gate=gate, export=export, checkpoint=ckpt, by="test_serve",
            name=NAME, stage="prod", tau=0.9, log=quiet)


@pytest.fixture(scope="module")
def release(tmp_path_factory):
    root = tmp_path_factory.mktemp("serve")
    store_uri = str(root / "store")
    publish(root / "v1", store_uri, seed=0)
    from mars.core.models import load_model

    model, tokenizer = load_model(root / "v1" / "checkpoint")
    return {"root": root, "store": store_uri, "model": model, "tokenizer": tokenizer}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def metrics(url: str) -> dict[str, float]:
    """One scrape of /metrics: each sample's value by its name (with labels)."""
    lines = httpx.get(url + "/metrics").text.splitlines()
    return {name: float(value) for name, value in (line.rsplit(" ", 1) for line in lines if not line.startswith("#"))}


def metric(url: str, name: str) -> float:
    for sample, value in metrics(url).items():
        if sample == name or sample.startswith(name + "{"):
            return value
    raise KeyError(name)


def wait_until_taken(url: str, count: int, timeout: float = 60) -> None:
    """Until the server has taken ``count`` generation requests (waiting, in the batch, or answered): a
    request still on its way (sent by a client thread, not yet parsed) would meet a shutdown as a new one."""
    deadline = time.monotonic() + timeout
    while True:
        now = metrics(url)
        answered = sum(v for k, v in now.items() if k.startswith("mars_requests_total{"))
        if now["mars_running_requests"] + now["mars_queue_depth"] + answered >= count:
            return
        assert time.monotonic() < deadline, f"the server did not take {count} requests in {timeout} s"
        time.sleep(0.01)


class Running:
    """`mars serve --release mars --stage prod` in a thread of this process (uvicorn on a free port)."""

    def __init__(self, release, cache: Path, *, api_key: str | None = None, poll: float = 0.0, drain: float = 30,
                 **cfg):
        self.cfg = ServeConfig(port=free_port(), poll_seconds=poll, drain_seconds=drain, **cfg)
        self.built = build(self.cfg, release=NAME, stage="prod", store=open_store(release["store"]), cache=cache,
                           api_key=api_key)
        self.server = make_server(self.built, self.cfg, log_level="warning")
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert time.monotonic() < deadline and self.thread.is_alive(), "server did not start"
            time.sleep(0.02)
        self.url = f"http://127.0.0.1:{self.cfg.port}"
        self.client = openai.OpenAI(base_url=f"{self.url}/v1", api_key=api_key or "none", max_retries=0)

    def post(self, path: str, body, **kw) -> httpx.Response:
        content = body if isinstance(body, (str, bytes)) else json.dumps(body)
        return httpx.post(self.url + path, content=content, headers={"content-type": "application/json"},
                          timeout=60, **kw)

    def metric(self, name: str) -> float:
        return metric(self.url, name)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(30)
        for engine in self.built.serving.engines():
            engine.close(drain=False, timeout=10)


@pytest.fixture(scope="module")
def server(release, tmp_path_factory):
    running = Running(release, tmp_path_factory.mktemp("cache"), max_batch=8, max_queue=32)
    yield running
    running.stop()


def chat(server, prompt: str, **kw):
    extra = {k: kw.pop(k) for k in ("tau", "mode", "block_size", "tree") if k in kw}
    return server.client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": prompt}],
                                                 extra_body=extra or None, **kw)


def alone(release, prompt, tau: float, max_tokens: int, **kw):
    return generate(release["model"], release["tokenizer"], [prompt], tau=tau, max_new_tokens=max_tokens, **kw)[0]


# ------------------------------------------------------------------------------------------- behaviour

def test_greedy_tau_one_equals_mars_generate(server, release):
    for prompt in PROMPTS:
        reference = alone(release, prompt, 1.0, 24)
        out = chat(server, prompt, temperature=0, max_tokens=24, tau=1.0)
        assert out.choices[0].message.content == reference.text
        assert out.usage.completion_tokens == len(reference.token_ids) == 24
        assert out.usage.forwards == reference.forwards and out.usage.tokens_per_forward == 1.0
        assert out.choices[0].finish_reason == "length"
    ids = release["tokenizer"]("3 plus 4 is")["input_ids"]  # /v1/completions with token ids: no chat template
    out = server.client.completions.create(model=NAME, prompt=ids, temperature=0, max_tokens=12,
                                           extra_body={"tau": 1.0})
    assert out.choices[0].text == alone(release, ids, 1.0, 12).text


def test_each_request_keeps_its_own_tau_inside_one_running_batch(server, release):
    taus = [1.0, 0.9, 0.7, 0.5, 0.3, 0.9, 0.5, 1.0]
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(len(taus))]
    steps_before = server.metric("mars_decoding_steps_total")
    with ThreadPoolExecutor(len(taus)) as pool:
        outs = list(pool.map(lambda pt: chat(server, pt[0], temperature=0, max_tokens=32, tau=pt[1]),
                             zip(prompts, taus)))
    steps = server.metric("mars_decoding_steps_total") - steps_before
    for prompt, tau, out in zip(prompts, taus, outs):
        reference = alone(release, prompt, tau, 32)
        assert out.choices[0].message.content == reference.text, tau
        assert out.usage.forwards == reference.forwards
        assert out.usage.tau == pytest.approx(tau)
    assert max(o.usage.tokens_per_forward for o in outs) > 1.5  # the low taus did read masks
    assert steps < sum(o.usage.forwards for o in outs)  # requests shared steps: one running batch


def test_lossless_mode_and_block_size_per_request(server, release):
    reference = alone(release, PROMPTS[0], 1.0, 20)
    out = chat(server, PROMPTS[0], temperature=0, max_tokens=20, mode="lossless")
    assert out.choices[0].message.content == reference.text
    narrow = chat(server, PROMPTS[0], temperature=0, max_tokens=20, mode="lossless", block_size=2)
    assert narrow.choices[0].message.content == reference.text  # one draft a step: the same greedy tokens
    capped = chat(server, PROMPTS[1], temperature=0, max_tokens=20, tau=0.3, block_size=2)
    assert 1.0 < capped.usage.tokens_per_forward <= 2.0
    one = chat(server, PROMPTS[1], temperature=0, max_tokens=20, tau=0.3, block_size=1)
    assert one.choices[0].message.content == alone(release, PROMPTS[1], 1.0, 20).text  # B = 1 is AR


def test_a_request_may_verify_a_draft_tree(server, release):
    for prompt in PROMPTS[:2]:
        reference = alone(release, prompt, 1.0, 20, mode="lossless", tree="top2/6")
        out = chat(server, prompt, temperature=0, max_tokens=20, mode="lossless", tree="top2/6")
        assert out.choices[0].message.content == reference.text == alone(release, prompt, 1.0, 20).text
        assert out.usage.forwards == reference.forwards


def test_streaming_gives_the_non_streaming_text(server):
    for kwargs in ({"tau": 1.0}, {"tau": 0.5}, {"tau": 0.5, "stop": ["the", "3"]}, {"temperature": 0.8, "seed": 7}):
        kw = {"temperature": 0, "max_tokens": 30, **kwargs}
        whole = chat(server, PROMPTS[1], **kw)
        stream = chat(server, PROMPTS[1], stream=True, stream_options={"include_usage": True}, **kw)
        chunks = list(stream)
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert text == whole.choices[0].message.content
        assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == whole.choices[0].finish_reason
        assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    stopped = chat(server, PROMPTS[1], temperature=0, max_tokens=30, stop=["the"])
    unstopped = chat(server, PROMPTS[1], temperature=0, max_tokens=30)
    if "the" in unstopped.choices[0].message.content:
        assert stopped.choices[0].finish_reason == "stop"
        assert stopped.choices[0].message.content == unstopped.choices[0].message.content.split("the")[0]
    plain = server.client.completions.create(model=NAME, prompt="the cat", temperature=0, max_tokens=16)
    streamed = server.client.completions.create(model=NAME, prompt="the cat", temperature=0, max_tokens=16, stream=True)
    assert "".join(c.choices[0].text for c in streamed) == plain.choices[0].text


@pytest.mark.parametrize("path, body, status, param", [
    ("/v1/completions", {"model": NAME, "prompt": [5] * 256}, 400, "prompt"),  # the context is 256
    ("/v1/chat/completions", {"model": NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 0},
     400, "max_tokens"),
    ("/v1/chat/completions", {"model": NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 10**6},
     400, "max_tokens"),
    ("/v1/chat/completions", {"model": NAME, "messages": [{"role": "user", "content": "hi"}], "tau": 0}, 400, "tau"),
    ("/v1/chat/completions", {"model": NAME, "messages": [{"role": "user", "content": "hi"}], "tau": 1.5}, 400, "tau"),
    ("/v1/chat/completions", '{"model": "mars", "messages": [', 400, "body"),
    ("/v1/chat/completions", {"model": "gpt-4", "messages": [{"role": "user", "content": "hi"}]}, 404, "model"),
    ("/v1/chat/completions", {"model": NAME, "messages": []}, 400, "messages"),
    ("/v1/chat/completions", {"model": NAME, "messages": [{"role": "user", "content": "hi"}], "block_size": 9},
     400, "block_size"),
    ("/v1/chat/completions", {"model": NAME, "messages": [{"role": "user", "content": "hi"}], "mode": "lossless",
                              "temperature": 0.7}, 400, "mode"),
    ("/v1/chat/completions", {"model": NAME, "messages": [{"role": "user", "content": "hi"}], "mode": "lossless",
                              "temperature": 0, "tree": "top-2"}, 400, "tree"),
    ("/v1/chat/completions", {"model": NAME, "messages": [{"role": "user", "content": "hi"}], "tree": "top2"},
     400, "tree"),
    ("/v1/completions", {"model": NAME, "prompt": "hi", "temperature": -1}, 400, "temperature"),
    ("/v1/completions", {"model": NAME, "prompt": "hi", "n": 2}, 400, "n"),
    ("/v1/completions", {"model": NAME}, 400, "prompt"),
])
def test_bad_input_gets_a_4xx_naming_the_field_and_the_server_keeps_serving(server, path, body, status, param):
    response = server.post(path, body)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["param"] == param and param in error["message"] and error["type"]
    assert chat(server, "hi", temperature=0, max_tokens=3).usage.completion_tokens == 3


def test_openai_client_raises_its_own_errors(server):
    with pytest.raises(openai.NotFoundError):
        server.client.chat.completions.create(model="nope", messages=[{"role": "user", "content": "hi"}])
    with pytest.raises(openai.BadRequestError) as err:
        chat(server, "hi", tau=2.0)
    assert err.value.body["param"] == "tau"


def test_models_health_and_metrics(server):
    models = server.client.models.list().data
    assert [m.id for m in models] == [NAME]
    assert models[0].block_size == B and models[0].tau == 0.9 and models[0].tau_floor == 0.5
    assert httpx.get(server.url + "/health").json() == {"status": "ok", "model": NAME, "version": "v1"}
    copied = server.metric("mars_prefix_cache_tokens_total")
    chat(server, "hi", temperature=0, max_tokens=4)
    text = httpx.get(server.url + "/metrics").text
    for name in ("mars_queue_depth", "mars_tau_in_use", "mars_step_cost_seconds{", "mars_running_requests",
                 'mars_release_info{name="mars",version="v1"} 1.0'):
        assert name in text
    # every request's prompt joins the batch in some step: that step's seconds count as joining
    assert 0 < server.metric("mars_joining_step_seconds_total") <= server.metric("mars_step_seconds_sum")
    # the chat prompt's head came from the prefix cache; raw token ids that do not start with it did not
    head = chat_head(server.built.serving.engines()[0].model.tokenizer)
    assert head and server.metric("mars_prefix_cache_tokens_total") == copied + len(head)
    server.client.completions.create(model=NAME, prompt=[7, 8, 9], temperature=0, max_tokens=2)
    assert server.metric("mars_prefix_cache_tokens_total") == copied + len(head)


def test_the_prompt_head_is_the_chat_templates_system_turn_and_user_header(smollm2_dir):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    head = chat_head(tokenizer)
    assert tokenizer.decode(head) == ("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by "
                                      "Hugging Face<|im_end|>\n<|im_start|>user\n")
    assert encode_prompts(tokenizer, ["What is 2 + 3?"])[0][: len(head)] == head
    tokenizer.chat_template = None
    assert chat_head(tokenizer) == []


def test_seeded_sampling_is_reproducible(server):
    a = chat(server, PROMPTS[2], temperature=1.0, seed=11, max_tokens=20, tau=0.7)
    b = chat(server, PROMPTS[2], temperature=1.0, seed=11, max_tokens=20, tau=0.7)
    assert a.choices[0].message.content == b.choices[0].message.content


def test_sampling_at_tau_one_follows_the_ar_distribution(release):
    """Slot 0 is an ordinary AR sample; at tau = 1.0 so is every token: the first token's frequencies over
    seeded samples match the model's softmax, and so do the second token's given the most frequent first."""
    model = tiny_model("llama", seed=3, vocab=40)
    with torch.no_grad():
        model.lm_head.weight.mul_(3)  # spread over a dozen tokens or so
    prompt, n, temperature = [5, 9, 2, 7], 3000, 0.9
    batch = CachedBatch(TorchBackend(model), block_size=B, stop_ids=torch.tensor([], dtype=torch.long), mask_id=39)
    rows = [DecodeRow(prompt, 2, Setting(), sampler=Sampler(SamplingParams(temperature, seed=s))) for s in range(n)]
    samples = []
    for start in range(0, n, 500):
        batch.add(rows[start:start + 500])
        while len(batch):
            samples += [u.token_ids for u in batch.step() if u.done]

    def check(prefix, observed):
        with torch.no_grad():
            probs = filtered_probs(model(torch.tensor([prefix])).logits[0, -1], temperature, 1.0).double()
        counts = torch.bincount(torch.tensor(observed), minlength=probs.numel()).double()
        keep = probs * len(observed) >= 5  # chi-square needs expected counts >= 5: pool the tail
        f_obs, f_exp = counts[keep], probs[keep] * len(observed)
        if not keep.all():
            f_obs, f_exp = torch.cat([f_obs, counts[~keep].sum()[None]]), torch.cat([f_exp, f_exp.new_tensor(
                [len(observed) - float(f_exp.sum())])])
        stat = ((f_obs - f_exp) ** 2 / f_exp).sum()
        p_value = torch.special.gammaincc(torch.tensor((len(f_obs) - 1) / 2, dtype=torch.float64), stat / 2)
        assert p_value > 1e-3, (stat, len(f_obs))  # chi-square goodness of fit
        return 0.5 * (counts / len(observed) - probs).abs().sum().item()

    assert check(prompt, [s[0] for s in samples]) < 0.05  # total variation
    first = max(set(s[0] for s in samples), key=[s[0] for s in samples].count)
    check(prompt + [first], [s[1] for s in samples if s[0] == first])


def confident_model():
    """A random tiny Llama with sharpened logits (tau < 1 accepts a varying number of slots), labelled as a
    MARS checkpoint with B = 4 and mask id 95: the step core's tests below run on it without a server."""
    model = tiny_model("llama", seed=5, vocab=96)
    with torch.no_grad():
        model.lm_head.weight.mul_(60)
    model.config.mars = {"block_size": B, "mask_token_id": 95}
    return model


def test_rows_joining_a_running_batch_decode_as_they_would_alone():
    """The step core under the server: rows join at any step (into finished rows' places or appended),
    each with its own tau or mode, and get the tokens generate() gives them alone."""
    model = confident_model()
    model.generation_config.eos_token_id = 63
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 90, (n,), generator=g).tolist() for n in (5, 9, 3, 12, 7, 4)]
    settings = [(1.0, False), (0.5, False), (1.0, True), (0.3, False), (0.7, False), (1.0, True)]
    rooms = [2, 30, 20, 25, 12, 18]  # row 0 is done after step 1: the first row joining at step 2 takes its place
    rows = [DecodeRow(p, r, Setting(tau=tau, lossless=lossless), key=i) for i, (p, r, (tau, lossless)) in
            enumerate(zip(prompts, rooms, settings))]
    batch = CachedBatch(TorchBackend(model), block_size=B, stop_ids=torch.tensor([63]), mask_id=95)
    out, step = {}, 0
    batch.add(rows[:2])
    while len(batch) or step < 8:
        if step in (2, 4):  # mid-run: three rows, then one (a finished row's place, or appended)
            batch.add(rows[2:5] if step == 2 else rows[5:])
        out.update({u.row.key: u.token_ids for u in batch.step() if u.done})
        step += 1
    for i, (tau, lossless) in enumerate(settings):
        alone = generate(model, None, [prompts[i]], tau=tau, mode="lossless" if lossless else "tau",
                         max_new_tokens=rooms[i])[0]
        assert out[i] == alone.token_ids, i


def test_a_row_moved_between_the_lossless_mode_and_tau_one_stays_greedy_and_drops_its_drafts():
    """The adaptive policy moves greedy rows between the lossless mode and the taus between steps: both
    lossless and tau = 1.0 are greedy, so a row flipped every step gets the greedy tokens; a row that
    leaves the lossless mode with drafts pending drops them: at tau = 1 it forwards its real tokens only
    (the rest of its window repeats the last one) and masks wait where the drafts were."""
    model = confident_model()
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 90, (n,), generator=g).tolist() for n in (6, 11)]
    windows = []

    class Spy(TorchBackend):
        def forward(self, window, positions, read):
            windows.append(window.clone())
            return super().forward(window, positions, read)

    batch = CachedBatch(Spy(model), block_size=B, stop_ids=torch.tensor([], dtype=torch.long), mask_id=95)
    flipped = DecodeRow(prompts[0], 24, Setting(lossless=True), key="flipped")
    other = DecodeRow(prompts[1], 12, Setting(tau=0.5), key="other")  # reads masks: the batch's windows are B wide
    batch.add([flipped, other])
    out, step, checked = {}, 0, 0
    while len(batch):
        k = batch.rows.index(flipped)  # 0: the first row added (a finished one leaves from behind it)
        leaving = flipped.setting.lossless and int(batch.drafts[k]) > 0 and other in batch.live
        flipped.setting = Setting(lossless=not flipped.setting.lossless)
        u = int(batch.length[k] - batch.cached[k])  # its real tokens not in the cache yet
        out.update({r.row.key: r.token_ids for r in batch.step() if r.done})
        if leaving:
            window = windows[-1][k].tolist()
            assert window[u:] == [window[u - 1]] * (len(window) - u)
            length = int(batch.length[k])  # one token on: the drafts' other places hold masks again
            assert batch.seq[k, length:length + B - 2].tolist() == [95] * (B - 2)
            checked += 1
        step += 1
    assert checked > 0 and step > 6
    assert out["flipped"] == generate(model, None, [prompts[0]], tau=1.0, max_new_tokens=24)[0].token_ids


def test_a_rows_first_step_in_a_new_setting_is_not_counted_as_the_settings_yield():
    """After a move into the lossless mode (no drafts yet), to another lossless width or out of it (a cache
    holding every verified draft), a row's first step yields what its old setting left it: the engine hands
    the policy no yield for it, and marks the step unclean (its cost is not the setting's either). A joining
    request's first step is its setting's own: its yield counts, its cost (a prefill) does not."""
    import asyncio
    import itertools

    from mars.serving.engine import Engine, GenerationRequest
    from mars.serving.served_model import ServedModel
    from mars.decoding.tau_policy import PolicySnapshot

    model = confident_model()
    lossless, narrow = Setting(lossless=True), Setting(lossless=True, width=2)
    script = [lossless, lossless, narrow, narrow, narrow, lossless, lossless, Setting(), Setting(), lossless,
              lossless, Setting(tau=0.5), Setting(tau=0.5)]

    class Scripted:  # the engine's side of the policy contract, on a fixed sequence of settings
        snapshot = PolicySnapshot(Setting())

        def __init__(self):
            self.settings, self.seen = itertools.cycle(script), []

        def choose(self, rows, named=(), greedy=True):
            self.setting = next(self.settings)
            return self.setting

        def observe(self, step):
            self.seen.append((self.setting, step))

    policy = Scripted()
    served = ServedModel("m", None, lambda: TorchBackend(model), B, 95, [], None, 1.0, 1.0)
    engine = Engine(served, policy, max_batch=1)

    async def run():
        handle = engine.submit(GenerationRequest(list(range(3, 9)), 60), asyncio.get_running_loop())
        return [event async for event in handle.events()]

    events = asyncio.run(run())
    engine.close()
    steps = [len(e) for e in events if isinstance(e, list)]
    assert len(policy.seen) == len(steps) > len(script) and sum(steps) == 60
    for k, ((setting, step), tokens) in enumerate(zip(policy.seen, steps)):
        moved = k > 0 and setting != policy.seen[k - 1][0]
        # the prompt's step is the setting's own (a request's first step), but not a clean decoding step
        assert step.yields == ([] if moved else [(setting, tokens)]), (k, setting)
        assert step.clean == (k > 0 and not moved) and step.rows == 1 and step.slots == setting.slots(B)


def test_engines_side_by_side_are_stepped_by_one_thread_and_each_drains_on_close():
    """Two engines in one process (a hot swap's old and new release, a benchmark's settings) share the
    process's step thread: both decode their requests as they would alone, every step of either runs on
    that one thread, and close(drain=True) returns once an engine's last request finished."""
    import asyncio
    import threading

    from mars.serving.engine import Engine, Finished, GenerationRequest
    from mars.serving.served_model import ServedModel
    from mars.decoding.tau_policy import FixedPolicy

    model = confident_model()
    prompts = [list(range(3, 9)), list(range(20, 24)), list(range(40, 47))]

    class Watched(FixedPolicy):  # the fixed policy, noting the thread each step runs on
        def __init__(self):
            super().__init__(Setting())
            self.threads = set()

        def observe(self, *args, **kwargs):
            self.threads.add(threading.get_ident())

    policies = [Watched(), Watched()]
    engines = [Engine(ServedModel(f"m{i}", None, lambda: TorchBackend(model), B, 95, [], None, 1.0, 1.0), policy)
               for i, policy in enumerate(policies)]

    async def run():
        loop = asyncio.get_running_loop()

        async def one(engine, prompt):
            events = [e async for e in engine.submit(GenerationRequest(prompt, 20), loop).events()]
            return events[-1]

        return await asyncio.gather(*(one(e, p) for e in engines for p in prompts))

    results = asyncio.run(run())
    assert [engine.close(drain=True, timeout=30) for engine in engines] == [True, True]
    alone = [generate(model, None, [p], tau=1.0, max_new_tokens=20)[0].token_ids for p in prompts]
    assert all(isinstance(r, Finished) for r in results)
    assert [r.token_ids for r in results] == alone + alone
    stepped_on = policies[0].threads | policies[1].threads
    assert len(stepped_on) == 1 and stepped_on != {threading.get_ident()}


def test_top_p_samples_only_inside_the_nucleus():
    logits = torch.tensor([[4.0, 3.0, 1.0, 0.0, -1.0]])
    probs = filtered_probs(logits, 1.0, 0.8)
    assert probs[0, 2:].sum() == 0 and torch.isclose(probs.sum(), torch.tensor(1.0))
    sampler = Sampler(SamplingParams(1.0, top_p=0.8, seed=0))
    assert {int(sampler(logits)[0]) for _ in range(200)} == {0, 1}


def test_full_queue_answers_429_with_retry_after_and_api_key_is_required(release, tmp_path):
    tight = Running(release, tmp_path / "cache", api_key="s3cret", max_batch=1, max_queue=1, default_max_tokens=200)
    try:
        assert httpx.get(tight.url + "/v1/models").status_code == 401
        assert httpx.get(tight.url + "/health").status_code == 200  # probes need no key
        body = {"model": NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
        assert tight.post("/v1/chat/completions", body).status_code == 401
        wrong = httpx.post(tight.url + "/v1/chat/completions", json=body, headers={"authorization": "Bearer nope"})
        assert wrong.status_code == 401 and wrong.json()["error"]["code"] == "invalid_api_key"
        with ThreadPoolExecutor(2) as pool:
            running = pool.submit(chat, tight, PROMPTS[0], temperature=0, max_tokens=200)
            while tight.metric("mars_running_requests") < 1:
                time.sleep(0.01)
            waiting = pool.submit(chat, tight, PROMPTS[1], temperature=0, max_tokens=5)
            while tight.metric("mars_queue_depth") < 1 and not waiting.done():
                time.sleep(0.01)
            full = httpx.post(tight.url + "/v1/chat/completions", json=body,
                              headers={"authorization": "Bearer s3cret"})
            assert full.status_code == 429 and full.headers["retry-after"] == "1"
            assert full.json()["error"]["type"] == "rate_limit_error"
            assert running.result().usage.completion_tokens == 200
            assert waiting.result().usage.completion_tokens == 5
    finally:
        tight.stop()


def test_a_steps_tokens_reach_their_requests_in_order_with_one_wake_up_of_the_loop():
    """The engine thread hands a step's items (token lists, Finished records) to every request at once: one
    call into the event loop per step, not one per row, and each request sees its own items in order."""
    import asyncio

    from mars.serving.engine import Finished, GenerationRequest, RequestHandle, deliver

    loop = asyncio.new_event_loop()
    server = threading.Thread(target=loop.run_forever, daemon=True)
    server.start()
    wake_ups = []
    real = loop.call_soon_threadsafe
    loop.call_soon_threadsafe = lambda *a: wake_ups.append(a) or real(*a)
    try:
        handles = [RequestHandle(GenerationRequest([5], 4), loop, DecodeRow([5], 4)) for _ in range(3)]
        done = Finished([7, 8], 1, "length", [1.0])
        deliver([(handles[0], [7]), (handles[1], [9]), (handles[0], [8]), (handles[0], done)])
        deliver([(handles[2], [1])])
        assert len(wake_ups) == 2  # one per step

        async def drain(handle, n):
            return [await handle.queue.get() for _ in range(n)]

        got = [asyncio.run_coroutine_threadsafe(drain(h, n), loop).result(5) for h, n in zip(handles, (3, 1, 1))]
        assert got == [[[7], [8], done], [[9]], [[1]]]
    finally:
        loop.call_soon_threadsafe(loop.stop)
        server.join(5)
        loop.close()


def test_a_stream_whose_client_goes_away_leaves_the_batch(release, tmp_path):
    one = Running(release, tmp_path / "cache", max_batch=1)
    try:
        tokens_before = one.metric("mars_generated_tokens_total")
        with httpx.stream("POST", one.url + "/v1/completions", timeout=30, json={
                "model": NAME, "prompt": [5, 6, 7], "max_tokens": 240, "temperature": 0, "stream": True}) as r:
            next(r.iter_lines())  # the first chunk, then the client hangs up
        deadline = time.monotonic() + 10
        while one.metric("mars_running_requests") > 0:  # the engine let go of it
            assert time.monotonic() < deadline
            time.sleep(0.01)
        after = chat(one, "hi", temperature=0, max_tokens=5)  # the row is free for the next request
        assert after.usage.completion_tokens == 5
        assert one.metric("mars_generated_tokens_total") - tokens_before < 240
    finally:
        one.stop()


def test_hot_swap_under_load_loses_no_request_and_a_bad_release_keeps_the_old(tmp_path):
    store = {"store": str(tmp_path / "store")}  # its own store: this test moves prod
    publish(tmp_path / "v1", store["store"], seed=0)
    live = Running(store, tmp_path / "cache", poll=3600, max_batch=4, max_queue=64)  # polled by hand below
    try:
        watch = live.built.watch
        publish(tmp_path / "v2", store["store"], seed=1)
        with ThreadPoolExecutor(12) as pool:
            load = [pool.submit(chat, live, PROMPTS[i % 4], temperature=0, max_tokens=40, tau=0.7) for i in range(24)]
            time.sleep(0.2)
            assert watch.check()  # v2 loaded beside v1; new requests go to v2, v1 drains
            after = [pool.submit(chat, live, PROMPTS[0], temperature=0, max_tokens=10, tau=1.0) for _ in range(4)]
            outs = [f.result() for f in load + after]
        assert all(o.usage.completion_tokens == 40 for o in outs[:24])
        from mars.core.models import load_model

        v2, tok = load_model(tmp_path / "v2" / "checkpoint")
        assert {o.choices[0].message.content for o in outs[24:]} == {generate(v2, tok, [PROMPTS[0]], tau=1.0,
                                                                             max_new_tokens=10)[0].text}
        assert {o.system_fingerprint for o in outs[24:]} == {"v2"}
        assert httpx.get(live.url + "/health").json()["version"] == "v2"

        publish(tmp_path / "v3", store["store"], seed=2, broken=True)
        assert not watch.check() and "v3" in watch.last_error
        assert httpx.get(live.url + "/health").json()["version"] == "v2"
        assert chat(live, PROMPTS[0], temperature=0, max_tokens=10, tau=1.0).system_fingerprint == "v2"
        assert live.metric("mars_release_load_failures_total") == 1
    finally:
        live.stop()


def test_the_default_policy_decodes_unnamed_requests_greedily_and_named_ones_as_named(release, tmp_path):
    """`mars serve`'s default policy (adaptive, no floor) chooses among tau = 1 and the lossless mode at B and at
    width 2: every request that names no tau gets the greedy tokens, whatever setting its steps ran at."""
    adaptive = Running(release, tmp_path / "cache", max_batch=8, policy=PolicyConfig(decide_every=2, explore_every=8))
    try:
        with ThreadPoolExecutor(8) as pool:
            outs = list(pool.map(lambda i: chat(adaptive, PROMPTS[i % 4], temperature=0, max_tokens=32), range(16)))
        named = chat(adaptive, PROMPTS[0], temperature=0, max_tokens=16, tau=0.3)
        assert named.usage.tau == pytest.approx(0.3)  # a request that names its tau keeps it
        assert all(o.usage.tau == 1.0 for o in outs)
        assert any(o.usage.lossless_steps for o in outs)
        for i, o in enumerate(outs):
            assert o.choices[0].message.content == alone(release, PROMPTS[i % 4], 1.0, 32).text
        text = httpx.get(adaptive.url + "/metrics").text
        assert 'window="1"' in text and f'window="{2 * B - 1}"' in text  # it measured tau = 1 and lossless at B
        by_setting = {line.split('"')[1]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                      if line.startswith("mars_policy_steps_total{")}  # where the policy spent its steps
        assert set(by_setting) == {"lossless", "lossless:w=2", "tau=1"}  # unmeasured candidates are tried first
        assert sum(by_setting.values()) <= adaptive.metric("mars_decoding_steps_total")
        assert adaptive.metric("mars_tau_in_use") == 1.0
        assert 'mars_tokens_per_forward{setting="lossless"}' in text
    finally:
        adaptive.stop()


def test_a_floor_makes_a_lossy_tau_a_candidate_of_the_policy(release, tmp_path):
    floored = Running(release, tmp_path / "cache", max_batch=4,
                      policy=PolicyConfig(tau_floor="release", decide_every=2, explore_every=8))
    try:
        with ThreadPoolExecutor(4) as pool:
            outs = list(pool.map(lambda i: chat(floored, PROMPTS[i % 4], temperature=0, max_tokens=32), range(8)))
        floor = floored.built.serving.current.model.tau_floor
        assert floor == 0.5 and any(o.usage.tau < 1.0 for o in outs)  # the release's floor was tried
        assert all(floor - 1e-9 <= o.usage.tau <= 1.0 for o in outs)
    finally:
        floored.stop()


def test_the_release_floor_is_the_gates_passed_speed_tau():
    from mars.release.promote import tau_floor

    passed = {"checks_passed": True, "speed_tau": 0.8,
              "checks": [{"name": "score_at_speed_tau", "passed": True, "tau": 0.8}]}
    assert tau_floor(passed, 0.9) == 0.8
    assert tau_floor(passed, 0.7) == 0.7  # never above the release's default
    assert tau_floor({**passed, "checks_passed": False}, 0.9) == 0.9  # an overridden gate vouches for nothing
    assert tau_floor({**passed, "checks": []}, 0.9) == 0.9  # no score measured at the speed tau


@pytest.mark.slow
def test_the_onnx_backend_serves_the_release_export(tmp_path):
    """--backend onnx: the release's exported block forward, same tokens as the PyTorch decoder."""
    publish(tmp_path / "v1", str(tmp_path / "store"), seed=0, onnx=True)
    from mars.core.models import load_model

    model, tokenizer = load_model(tmp_path / "v1" / "checkpoint")
    release = {"store": str(tmp_path / "store")}
    onnx = Running(release, tmp_path / "cache", backend="onnx", max_batch=8)
    try:
        assert onnx.built.serving.current.max_batch == 4  # the export's fixed batch
        taus = [1.0, 0.7, 0.5, 0.9, 1.0, 0.3]
        with ThreadPoolExecutor(len(taus)) as pool:
            outs = list(pool.map(lambda t: chat(onnx, PROMPTS[1], temperature=0, max_tokens=16, tau=t), taus))
        for tau, out in zip(taus, outs):
            assert out.choices[0].message.content == generate(model, tokenizer, [PROMPTS[1]], tau=tau,
                                                              max_new_tokens=16)[0].text
    finally:
        onnx.stop()


@pytest.mark.parametrize("drain, finished", [(30, True), (0, False)])
def test_an_exit_signal_drains_or_past_the_drain_time_cancels(release, tmp_path, drain, finished):
    """What SIGTERM runs (uvicorn's handler, called here in-process; the subprocess test sends the signal):
    new requests get 503 at once; taken ones finish within --drain-seconds, or are cancelled with a 503."""
    one = Running(release, tmp_path / "cache", max_batch=1, drain=drain)
    try:
        with ThreadPoolExecutor(3) as pool:
            taken = [pool.submit(one.post, "/v1/completions", {"model": NAME, "prompt": [5, 6, 7 + i],
                                                                "max_tokens": 200, "temperature": 0})
                     for i in range(3)]
            wait_until_taken(one.url, 3)
            one.server.handle_exit(signal.SIGTERM, None)
            if finished:  # (with no drain time the server may be gone before a late request gets there)
                late = one.post("/v1/completions", {"model": NAME, "prompt": [5], "max_tokens": 2})
                assert late.status_code == 503 and late.json()["error"]["code"] == "shutting_down"
                assert httpx.get(one.url + "/health").status_code == 503
            answers = [t.result() for t in taken]
        if finished:
            assert [a.status_code for a in answers] == [200] * 3, [a.text for a in answers]
            assert [a.json()["usage"]["completion_tokens"] for a in answers] == [200] * 3
        else:
            assert 503 in [a.status_code for a in answers]
        one.thread.join(30)
        assert not one.thread.is_alive()  # and then the server exits
    finally:
        one.stop()


@pytest.mark.slow
def test_sigterm_drains_taken_requests_and_answers_new_ones_503(release, tmp_path):
    """The real CLI in a subprocess: `mars serve --release`, SIGTERM while requests run."""
    port = free_port()
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[1])}
    proc = subprocess.Popen([sys.executable, "-m", "mars.cli", "serve", "--release", NAME, "--stage", "prod",
                             "--store", release["store"], "--cache", str(tmp_path / "cache"), "--port", str(port),
                             "--max-batch", "1", "--log-level", "warning"], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read().decode()
            try:
                if httpx.get(url + "/health").status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.2)
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
        with ThreadPoolExecutor(4) as pool:
            taken = [pool.submit(client.chat.completions.create, model=NAME, temperature=0, max_tokens=150,
                                 messages=[{"role": "user", "content": p}]) for p in PROMPTS]
            wait_until_taken(url, len(PROMPTS))
            proc.send_signal(signal.SIGTERM)
            late = httpx.post(url + "/v1/chat/completions", json={"model": NAME, "messages": [
                {"role": "user", "content": "hi"}]})
            assert late.status_code == 503 and late.json()["error"]["code"] == "shutting_down"
            assert [t.result().usage.completion_tokens for t in taken] == [150] * 4
        assert proc.wait(60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
