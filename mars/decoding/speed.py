"""``mars bench-decode``: MARS decoding speed against HF ``generate`` (greedy, KV cache), side by side.

One process, one model, one prompt set. Every repeat runs each configuration once, in rotating order
(interleaved, so a slow spell of a shared machine hits all of them); the table shows medians and two
ratios at the same batch size (> 1: MARS is faster):

* ``vs_hf``: HF seconds / MARS seconds. It mixes two things: what MARS gains by taking several tokens
  per forward, and what this engine gains over HF ``generate`` at all (its tau = 1 row shows that part).
* ``vs_ar``: MARS at tau = 1 (greedy AR, same engine, same cache) seconds / MARS seconds: the part
  that multi-token decoding alone buys on this hardware (only when 1.0 is among the taus).

Per batch size and tau it also prints tokens/forward and the ceiling of ``vs_ar``: tokens/forward x
t(1-token step) / t(B-token step), the steps timed alternately on the same prefilled cache. The
lossless mode (``lossless=True``, a row ``mars lossless``: greedy output, mask slots as verified drafts)
forwards the last token + B-1 drafts + B-1 masks once drafts are pending: its ceiling is taken with the
(2B-1)-token step, a slight underestimate (a step after a wrong draft forwards only B). Each of ``trees``
(rows ``mars tree <shape>``: the lossless mode with draft trees, :mod:`mars.decoding.tree`) is greedy too;
its ceiling is taken with the widest window its shape can forward (1 + ``TreeShape.max_window``); ``auto``
(a row ``mars tree auto``) chooses per step as it decodes, so it has no one window and no ceiling. At batch 1 the
table also has HF's prompt-lookup decoding (``prompt_lookup_num_tokens``: n-grams of the context as
drafts, the other method with no new parameters; HF runs it for one row only). ``=hf`` counts the
prompts whose output is HF greedy's token for token: every prompt for the greedy methods in fp32; in bf16
a window's width changes the rounding, so a near-tie can go the other way.
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

import torch

from mars.core.atomic import JSON_ERRORS, json_problem
from mars.core.checkpoint_info import CheckpointInfo
from mars.decoding.generate import encode_prompts, generate, stop_token_ids_of
from mars.decoding.tree_shape import AUTO, TreeShape
from mars.errors import MarsError
from mars.decoding.torch_backend import TorchBackend

# Used when neither --data nor --prompts is given: short instructions of the kind the tiny profile trains on.
DEFAULT_PROMPTS = [
    "What is 17 plus 25?", "Sort these numbers: 9, 2, 7, 4.", "Count the vowels in 'banana'.",
    "Write the word 'cat' three times, separated by commas.", "List three colors.",
    "Tom has 3 apples and buys 5 more. How many apples does he have?", "Reverse the letters of 'stone'.",
    "Which is larger, 48 or 84?", "Copy this sentence: the sky is blue.", "Format the date 2024-03-05 as 05/03/2024.",
    "Name two animals that live in the sea.", "What is 9 times 6?", "Sort alphabetically: pear, apple, fig.",
    "How many letters are in 'elephant'?", "Answer yes or no: is 15 an even number?", "What comes after Tuesday?",
]


def _jsonl_prompt(path: Path, line_no: int, line: str) -> str:
    try:
        row = json.loads(line)
    except JSON_ERRORS as err:
        raise MarsError(f"{path}:{line_no}: not valid JSON ({json_problem(err)})") from None
    if not isinstance(row, dict) or not isinstance(row.get("prompt"), str):
        raise MarsError(f"{path}:{line_no}: no 'prompt' text")
    return row["prompt"]


def load_prompts(tokenizer, count: int, *, data_dir: str | None = None, prompts_file: str | None = None
                 ) -> list[list[int]]:
    """``count`` prompts (cycled when there are fewer): the held-out prompts of prepared data, a prompt file
    (one per line, or .jsonl with a 'prompt' field), or :data:`DEFAULT_PROMPTS`."""
    if data_dir:
        from mars.training.data import load_split

        rows = load_split(data_dir, "heldout")
        prompts = [row["input_ids"][: row["prompt_len"]] for row in rows]
    elif prompts_file:
        path = Path(prompts_file)
        if not path.is_file():
            raise MarsError(f"{path}: no such prompts file")
        lines = [(n, line) for n, line in enumerate(path.read_text().splitlines(), 1) if line.strip()]
        texts = [_jsonl_prompt(path, n, line) if path.suffix == ".jsonl" else line for n, line in lines]
        prompts = encode_prompts(tokenizer, texts)
    else:
        prompts = encode_prompts(tokenizer, DEFAULT_PROMPTS)
    if not prompts:
        raise MarsError("bench-decode: no prompts")
    while len(prompts) < count:  # too few: cycle
        prompts = prompts + prompts
    return prompts[:count]


def hf_generate(model, prompts: list[list[int]], batch_size: int, max_new_tokens: int, pad_id: int,
                eos: list[int], prompt_lookup: int | None = None) -> tuple[list[list[int]], int]:
    """HF greedy with its KV cache, left-padded batches; returns (each prompt's tokens up to and with its
    EOS, in prompt order; forwards per row as MARS counts them: one row's calls of the model, the prefill
    giving the first token; batched plain greedy takes one per token). Prompts of similar length go together, as in
    :func:`mars.decoding.generate.generate` (less padding). ``prompt_lookup``: HF prompt-lookup decoding
    (``prompt_lookup_num_tokens``: n-grams of the context as drafts, verified by the model; batch 1 only)."""
    outputs: list[list[int] | None] = [None] * len(prompts)
    calls = [0]
    hook = model.register_forward_pre_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]), reverse=True)
    batches = range(0, len(prompts), batch_size)
    lookup = {} if prompt_lookup is None else {"prompt_lookup_num_tokens": prompt_lookup}
    try:
        for start in batches:
            picked = order[start: start + batch_size]
            batch = [prompts[i] for i in picked]
            width = max(map(len, batch))
            ids = torch.tensor([[pad_id] * (width - len(p)) + list(p) for p in batch], device=model.device)
            mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch], device=model.device)
            with torch.inference_mode():
                out = model.generate(ids, attention_mask=mask, max_new_tokens=max_new_tokens, do_sample=False,
                                     temperature=None, top_p=None, top_k=None, eos_token_id=eos or None,
                                     pad_token_id=pad_id, **lookup)[:, width:].tolist()
            for i, row in zip(picked, out):
                ends = [row.index(e) + 1 for e in eos if e in row]
                outputs[i] = row[: min(ends)] if ends else row
    finally:
        hook.remove()
    return outputs, calls[0] if batch_size == 1 else sum(map(len, outputs))


METHODS = {"hf": "hf_generate", "hf_lookup": "hf_prompt_lookup", "mars": "mars", "lossless": "mars_lossless",
           "tree": "mars_tree"}


def _sync(device) -> None:
    if str(device).startswith("cuda"):
        torch.cuda.synchronize()


def step_times(model, prompts: list[list[int]], batch_size: int, widths: list[int], iters: int = 40) -> list[float]:
    """Median seconds of one cached forward of each width (tokens per row, every one read) on a
    prefilled batch; the widths take turns, so a slow spell of the machine hits them alike."""
    backend = TorchBackend(model)
    batch = prompts[:batch_size]
    backend.start([p[:-1] for p in batch])
    rows, dev = len(batch), backend.device
    start = torch.tensor([len(p) - 1 for p in batch])[:, None]
    none = torch.zeros(rows, dtype=torch.long, device=dev)
    steps = [((start + torch.arange(w)).to(dev), torch.tensor([p[-1:] * w for p in batch], device=dev),
              torch.arange(w, device=dev).expand(rows, w)) for w in widths]
    times = [[] for _ in widths]
    for i in range(iters + 2):
        for k, (positions, window, read) in enumerate(steps):
            _sync(dev)
            t = time.perf_counter()
            backend.forward(window, positions, read)
            _sync(dev)
            times[k].append(time.perf_counter() - t)
            backend.commit(none)
    return [statistics.median(ts[2:]) for ts in times]


def run(model, tokenizer, prompts, *, batch_sizes, taus, block_size, max_new_tokens, b_cache, repeats,
        lossless: bool = True, prompt_lookup: int | None = 10, trees: tuple[TreeShape | str, ...] = ()):
    eos = stop_token_ids_of(model, tokenizer)
    pad_id = tokenizer.pad_token_id if tokenizer is not None and tokenizer.pad_token_id is not None else 0
    block_size = block_size or CheckpointInfo.block_size_of(model)
    if block_size is None:
        raise MarsError("bench-decode: pass --block-size (the checkpoint has no config.mars.block_size)")
    rows = []
    for bs in batch_sizes:
        configs = [("hf", None)] + ([("hf_lookup", None)] if prompt_lookup and bs == 1 else []) + \
            [("mars", tau) for tau in taus] + ([("lossless", None)] if lossless else []) + \
            [("tree", shape) for shape in trees]

        def once(kind, tau):
            _sync(model.device)
            t = time.perf_counter()
            if kind in ("hf", "hf_lookup"):
                outputs, forwards = hf_generate(model, prompts, bs, max_new_tokens, pad_id, eos,
                                                prompt_lookup if kind == "hf_lookup" else None)
                tpf = sum(map(len, outputs)) / forwards
            else:  # for a tree row, `tau` holds its shape
                res = generate(model, tokenizer, prompts, block_size=block_size,
                               tau=1.0 if kind == "tree" else tau or 1.0,
                               mode="tau" if kind == "mars" else "lossless", max_new_tokens=max_new_tokens,
                               batch_size=bs, b_cache=b_cache, tree=tau if kind == "tree" else None)
                outputs, tpf = [r.token_ids for r in res], res.tokens_per_forward
            _sync(model.device)
            return time.perf_counter() - t, outputs, tpf

        for kind, tau in configs:  # warm-up
            once(kind, tau)
        seconds = {c: [] for c in configs}
        stats = {}
        for r in range(repeats):
            for kind, tau in configs[r % len(configs):] + configs[: r % len(configs)]:
                dt, outputs, tpf = once(kind, tau)
                seconds[(kind, tau)].append(dt)
                stats[(kind, tau)] = (outputs, tpf)
        shapes = [shape for shape in trees if shape != AUTO]
        tree_widths = [1 + shape.max_window(block_size - 1) for shape in shapes]
        t1, tb, tw, *tt = step_times(model, prompts, bs, [1, block_size, 2 * block_size - 1, *tree_widths])
        t_tree = {**dict(zip(shapes, tt)), AUTO: None}
        hf_s = statistics.median(seconds[("hf", None)])
        ar_s = statistics.median(seconds[("mars", 1.0)]) if ("mars", 1.0) in seconds else None
        greedy = stats[("hf", None)][0]
        for kind, tau in configs:
            med = statistics.median(seconds[(kind, tau)])
            outputs, tpf = stats[(kind, tau)]
            tokens = sum(map(len, outputs))
            step = t_tree[tau] if kind == "tree" else tw if kind == "lossless" else \
                t1 if tau is not None and tau >= 1.0 else tb
            hf = kind.startswith("hf")
            rows.append({
                "batch_size": bs, "method": METHODS[kind],
                "tau": None if kind == "tree" else tau,
                "tree": (tau if tau == AUTO else tau.label) if kind == "tree" else None,
                "median_s": med, "speedup_vs_hf": hf_s / med,
                "speedup_vs_ar": None if hf or ar_s is None else ar_s / med,
                "tokens": tokens, "tokens_per_s": tokens / med,
                # prompts whose output is HF greedy's token for token (tau = 1, lossless and prompt lookup
                # are greedy: all of them in fp32; bf16 rounds differently per window width)
                "same_as_hf": sum(a == b for a, b in zip(outputs, greedy)),
                "tokens_per_forward": tpf,
                # tau = 1 forwards no mask: its step is the 1-token step
                "ceiling_speedup": None if hf or step is None else tpf * t1 / step,
                "t_step_1_ms": t1 * 1e3, "t_step_B_ms": tb * 1e3, "t_step_2B-1_ms": tw * 1e3,
                "t_step_tree_ms": step * 1e3 if kind == "tree" and step is not None else None,
            })
    return {"block_size": block_size, "b_cache": b_cache, "max_new_tokens": max_new_tokens,
            "prompts": len(prompts), "repeats": repeats, "prompt_lookup_num_tokens": prompt_lookup, "rows": rows}


def format_table(report: dict) -> str:
    lines = [f"B={report['block_size']} b_cache={report['b_cache']} prompts={report['prompts']} "
             f"max_new_tokens={report['max_new_tokens']} repeats={report['repeats']} (medians; vs_hf = HF s / MARS s, vs_ar = MARS tau=1 s / MARS s)",
             f"{'batch':>5} {'method':<17} {'median_s':>9} {'vs_hf':>7} {'vs_ar':>7} {'tok/fwd':>8} {'ceiling':>8} "
             f"{'tokens':>7} {'=hf':>5} {'tok/s':>8} {'t1_ms':>7} {'tB_ms':>7} {'t2B-1_ms':>8}"]
    ratio = lambda v: "" if v is None else f"{v:.2f}x"  # noqa: E731
    for row in report["rows"]:
        name = {"hf_generate": "hf generate", "hf_prompt_lookup": "hf lookup", "mars_lossless": "mars lossless"}.get(row["method"]) or \
            (f"tree {row['tree']}" if row.get("tree") else f"mars tau={row['tau']:g}")
        lines.append(f"{row['batch_size']:>5} {name:<17} {row['median_s']:>9.3f} {ratio(row['speedup_vs_hf']):>7} "
                     f"{ratio(row['speedup_vs_ar']):>7} {row['tokens_per_forward']:>8.2f} "
                     f"{ratio(row['ceiling_speedup']):>8} {row['tokens']:>7} {row['same_as_hf']:>5} "
                     f"{row['tokens_per_s']:>8.1f} "
                     f"{row['t_step_1_ms']:>7.2f} {row['t_step_B_ms']:>7.2f} {row['t_step_2B-1_ms']:>8.2f}")
    return "\n".join(lines)
