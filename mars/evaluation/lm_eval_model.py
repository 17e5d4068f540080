"""MARS as an lm-evaluation-harness model, registered under the name ``mars``.

``lm_eval`` finds models only in its own registry (no entry points), so the ``mars lm-eval`` verb
imports this module and then runs lm-eval's command line: ``mars lm-eval --model mars --model_args
pretrained=DIR,tau=0.9,block_size=4,batch_size=16 --tasks ...`` takes every ``lm_eval`` option.

- ``generate_until`` decodes with :func:`mars.decoding.generate.generate`: up to B tokens per forward,
  accepted at threshold ``tau`` (or verified drafts with ``mode=lossless``, a draft tree with
  ``tree=top2/16``), KV cache, continuous
  batching. Greedy only: sampling arguments are refused. ``until`` stop strings end a sequence at the
  token that completes one and are cut from the text, ``max_gen_toks`` caps it, as lm-eval's ``hf``
  model does; a request's ``gen_kwargs`` may carry its own ``tau``.
- ``loglikelihood`` and ``loglikelihood_rolling`` are the ``hf`` model's plain causal forward: a MARS
  checkpoint is an ordinary causal LM and MARS changes nothing there, so those scores do not depend on
  tau.
- Tokenization, truncation and chat templates (``--apply_chat_template``) are the ``hf`` model's
  (this class extends it), so at ``tau=1`` the generations are the ``hf`` model's greedy ones.

The decoding work per task (generated tokens, decoding forwards, seconds, requests) is kept in
:attr:`MarsLM.stats` and each generation in :attr:`MarsLM.generations`; lm-eval's results carry the
stats under ``config.mars``, and ``mars evaluate`` turns them into ``metrics/eval.json`` entries.
"""

from __future__ import annotations

import json
import logging
from typing import Any

import torch
from lm_eval.api.registry import register_model
from lm_eval.models.huggingface import HFLM
from lm_eval.models.utils import handle_stop_sequences, normalize_gen_kwargs, postprocess_generated_text
from tqdm import tqdm

from mars.config import build
from mars.decoding.generate import DecodeConfig
from mars.errors import MarsError

log = logging.getLogger("lm_eval.models.mars")  # lm-eval's handler and level, beside its own models' lines

# HFLM options that still apply to a model loaded here; its loading options (revision, peft, parallelize,
# ...) do not, and are refused rather than silently ignored.
HF_OPTIONS = {"truncation", "logits_cache", "max_length", "max_batch_size", "add_bos_token", "prefix_token_id",
              "think_end_token", "enable_thinking", "chat_template_args", "softmax_dtype", "mixed_precision_dtype"}
# Generation arguments that change nothing at temperature 0 (transformers ignores them without sampling).
GREEDY_NO_OPS = {"top_p", "top_k", "min_p", "typical_p"}


@register_model("mars")
class MarsLM(HFLM):
    """A MARS checkpoint (directory, ``smollm2`` or hub id, or a loaded model) for lm-eval."""

    def __init__(self, pretrained, tokenizer=None, *, tau: float = DecodeConfig.tau, mode: str = DecodeConfig.mode,
                 block_size: int | None = None, b_cache: int | None = None, use_cache: bool = True,
                 batch_size: int | str = DecodeConfig.batch_size, device: str | None = None, dtype: str | None = None,
                 attn_implementation: str = "sdpa", allow_untrained: bool = False, tree: str | None = None,
                 **options):
        unknown = sorted(set(options) - HF_OPTIONS)
        if unknown:
            raise MarsError(f"--model_args: unknown for the mars model: {', '.join(unknown)} (mars: pretrained, "
                            f"tokenizer, tau, mode, tree, block_size, b_cache, use_cache, batch_size, device, dtype, "
                            f"attn_implementation, allow_untrained; hf: {', '.join(sorted(HF_OPTIONS))})")
        if isinstance(options.get("think_end_token"), int):
            raise MarsError("--model_args think_end_token: give the token's text; a token id is not supported")
        self.decode = build(DecodeConfig, {"tau": tau, "mode": mode, "block_size": block_size, "b_cache": b_cache,
                                           "use_cache": use_cache, "batch_size": batch_size, "tree": tree},
                             "--model_args")
        if isinstance(pretrained, str):
            pretrained, tokenizer = self._load(pretrained, tokenizer, device, dtype, attn_implementation)
        elif tokenizer is None:
            raise MarsError("MarsLM: a loaded model needs its tokenizer (tokenizer=...)")
        super().__init__(pretrained=pretrained, tokenizer=tokenizer, batch_size=self.decode.batch_size, **options)
        self.allow_untrained = allow_untrained  # tau < 1 on a checkpoint never trained with masks
        self.stats: dict[str, dict] = {}  # task -> decoding totals
        self.generations: list[dict] = []  # one per generate_until request, in request order per call

    @staticmethod
    def _load(source: str, tokenizer, device: str | None, dtype: str | None, attn_implementation: str):
        from mars.core.models import load_model, load_tokenizer

        device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        if device.startswith("cuda") and not torch.cuda.is_available():
            log.warning("mars: device %s requested but CUDA is not available; using the CPU", device)
            device = "cpu"
        dtype = dtype or ("bfloat16" if device.startswith("cuda") else "float32")
        model, own_tokenizer = load_model(source, dtype=dtype, attn_implementation=attn_implementation, device=device)
        if isinstance(tokenizer, str):
            tokenizer = load_tokenizer(tokenizer)
        return model, tokenizer or own_tokenizer

    @classmethod
    def create_from_arg_obj(cls, arg_dict: dict, additional_config: dict | None = None) -> MarsLM:
        """As lm-eval's, except that ``--model_args`` win over the command line's own options (lm-eval
        always passes ``--batch_size``, default 1, and ``--device``, default cuda:0, beside them)."""
        extra = {k: v for k, v in (additional_config or {}).items() if v is not None and k not in arg_dict}
        return cls(**arg_dict, **extra)

    @classmethod
    def create_from_arg_string(cls, arg_string: str, additional_config: dict | None = None) -> MarsLM:
        from lm_eval.utils import simple_parse_args_string

        return cls.create_from_arg_obj(simple_parse_args_string(arg_string), additional_config)

    # ------------------------------------------------------------------------------------- generation

    def _settings(self, task: str, gen_kwargs: dict) -> tuple[list[str], int, float]:
        """``(until, max_gen_toks, tau)`` of one request's generation arguments; sampling is refused."""
        kwargs = normalize_gen_kwargs(gen_kwargs, self.max_gen_toks)
        if kwargs.pop("do_sample") or kwargs.pop("temperature", 0.0):
            raise MarsError(f"task {task}: MARS decodes greedily, but its generation arguments ask for sampling "
                            f"({gen_kwargs}); run it with --gen_kwargs do_sample=false,temperature=0")
        until = handle_stop_sequences(kwargs.pop("until", None), eos=self.tok_decode(self.eot_token_id,
                                                                                  skip_special_tokens=False))
        max_gen_toks = kwargs.pop("max_gen_toks")
        tau = kwargs.pop("tau", self.decode.tau)
        unsupported = sorted(set(kwargs) - GREEDY_NO_OPS)
        if unsupported:
            raise MarsError(f"task {task}: generation argument(s) {', '.join(unsupported)} are not supported by the "
                            "mars model (it takes until, max_gen_toks, tau; do_sample=false, temperature=0)")
        if max_gen_toks >= self.max_length:
            raise MarsError(f"task {task}: max_gen_toks {max_gen_toks} leaves no room for a prompt in the "
                            f"model's {self.max_length} positions")
        return until, max_gen_toks, tau

    def _encode(self, context: str, max_context: int) -> list[int]:
        """The prompt's token ids exactly as the ``hf`` model encodes a context for generation."""
        ids, _ = self.tok_batch_encode([context], left_truncate_len=max_context, truncation=self.truncation)
        return ids[0].tolist()

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        from mars.decoding.generate import generate

        # One decode call per task and generation arguments: stats stay per task, and a call shares
        # its stop strings and token budget.
        groups: dict[tuple[str, str], list[int]] = {}
        for i, req in enumerate(requests):
            groups.setdefault((req.task_name, json.dumps(req.args[1], sort_keys=True, default=str)), []).append(i)
        results: list[str] = [""] * len(requests)
        bar = tqdm(total=len(requests), disable=disable_tqdm or self.rank != 0, desc="mars generate_until")
        for (task, _), members in groups.items():
            gen_kwargs = requests[members[0]].args[1]
            until, max_gen_toks, tau = self._settings(task, gen_kwargs)
            contexts = [requests[i].args[0] for i in members]
            gens = generate(self.model, self.tokenizer, [self._encode(c, self.max_length - max_gen_toks) for c in contexts],
                            block_size=self.decode.block_size, tau=tau, mode=self.decode.mode,
                            max_new_tokens=max_gen_toks, batch_size=self.decode.batch_size,
                            use_cache=self.decode.use_cache, b_cache=self.decode.b_cache, stop_strings=until,
                            allow_untrained=self.allow_untrained, tree=self.decode.tree)
            for i, context, g in zip(members, contexts, gens):
                text = postprocess_generated_text(g.text, until, self.think_end_token)
                results[i] = text
                self.cache_hook.add_partial("generate_until", (context, gen_kwargs), text)
                self.generations.append({"task": task, "doc_id": requests[i].doc_id, "repeat": requests[i].idx,
                                         **g.to_dict(), "text": text, "raw_text": g.text})
            self._count(task, gens)
            bar.update(len(members))
        bar.close()
        return results

    def _count(self, task: str, gens) -> None:
        totals = self.stats.setdefault(task, {"tokens": 0, "forwards": 0, "seconds": 0.0, "n": 0, "model_calls": 0})
        totals["tokens"] += gens.tokens
        totals["forwards"] += gens.forwards
        totals["seconds"] += gens.seconds
        totals["n"] += len(gens)
        totals["model_calls"] += gens.model_calls
        totals["tokens_per_forward"] = totals["tokens"] / totals["forwards"] if totals["forwards"] else 0.0
        log.info("mars %s: %d tokens in %d forwards (%.2f tokens/forward), %.1f s", task, totals["tokens"],
                 totals["forwards"], totals["tokens_per_forward"], totals["seconds"])

    def get_model_info(self) -> dict[str, Any]:
        """What lm-eval records under ``config`` in its results: the decoding settings and work per task."""
        return {"model_num_parameters": sum(p.numel() for p in self.model.parameters()),
                "model_dtype": str(self.model.dtype),
                "mars": {**{k: getattr(self.decode, k) for k in ("tau", "mode", "block_size", "b_cache", "use_cache",
                                                                 "batch_size")},
                         "tasks": self.stats}}
