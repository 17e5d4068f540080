"""``/metrics``: the server's state in Prometheus text format (prometheus-client, one registry per server).

What an operator (and the HorizontalPodAutoscaler, through the Prometheus adapter) reads:
``mars_queue_depth`` (requests waiting for a batch row), ``mars_running_requests``, ``mars_tau_in_use``
(the policy's current tau), ``mars_lossless_in_use`` (1 while the adaptive policy decodes greedy rows in
the lossless mode), ``mars_step_cost_seconds{batch, window}`` (the measured decoding-step cost the
adaptive policy decides on; window: the widest row's slots, 1, w at a tau < 1, 2w-1 in the lossless
mode at block size w), ``mars_prompt_token_cost_seconds{batch}`` (what a joining prompt's token
costs beside a batch of that size, beyond the step it joined: the policy charges it to each generated token),
``mars_tokens_per_forward{tau}`` (tau="lossless" for the lossless mode,
"lossless:w" for it at a block size w below the checkpoint's), ``mars_policy_steps_total{arm}``
(steps by the arm the policy chose: where the adaptive policy spends its time),
``mars_prefix_cache_tokens_total`` (prompt tokens copied from the prefix cache instead of computed),
counters of requests by status, generated tokens and decoding steps, a step-time histogram,
``mars_joining_step_seconds_total`` (the part of it in steps that took new requests' prompts: prefill
beside the batch's decoding; the rest decodes), and
``mars_release_info`` (which release serves new requests).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from mars.serving.tau_policy import is_lossless


class ServerMetrics:
    def __init__(self):
        self.registry = registry = CollectorRegistry()
        self._policy = None  # the tau policy of the last engine step
        self.queue_depth = Gauge("mars_queue_depth", "requests waiting for a batch row", registry=registry)
        self.running = Gauge("mars_running_requests", "requests decoding in the batch", registry=registry)
        self.tau = Gauge("mars_tau_in_use", "the tau policy's current tau (rows that named no tau)",
                         registry=registry)
        self.lossless = Gauge("mars_lossless_in_use", "1 while the tau policy puts greedy rows in the lossless mode",
                              registry=registry)
        self.step_cost = Gauge("mars_step_cost_seconds", "measured seconds per decoding step (moving average)",
                               ["batch", "window"], registry=registry)
        self.prompt_token_cost = Gauge("mars_prompt_token_cost_seconds", "measured seconds per joining prompt token "
                                       "beyond its step, by the batch's size (moving median)", ["batch"],
                                       registry=registry)
        self.tokens_per_forward = Gauge("mars_tokens_per_forward", "measured tokens per row and forward at a tau",
                                        ["tau"], registry=registry)
        self.requests = Counter("mars_requests", "finished HTTP generation requests", ["status"], registry=registry)
        self.tokens = Counter("mars_generated_tokens", "tokens generated", registry=registry)
        self.steps = Counter("mars_decoding_steps", "batched decoding forwards", registry=registry)
        self.prefix_tokens = Counter("mars_prefix_cache_tokens", "prompt tokens copied from the prefix cache (the "
                                     "chat template's head) instead of computed", registry=registry)
        self.policy_steps = Counter("mars_policy_steps", "decoding steps by the arm the tau policy chose for the "
                                    "rows that named no tau (a tau, or lossless)", ["arm"], registry=registry)
        self.joining_seconds = Counter("mars_joining_step_seconds", "seconds in steps that took new requests' "
                                       "prompts (their prefill beside the batch's decoding)", registry=registry)
        self.step_seconds = Histogram("mars_step_seconds", "seconds per batched decoding step", registry=registry,
                                      buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5))
        self.release = Gauge("mars_release_info", "1 for the release serving new requests", ["name", "version"],
                             registry=registry)
        self.swap_failures = Counter("mars_release_load_failures", "releases that failed to load (the old kept "
                                     "serving)", registry=registry)

    def step(self, rows: int, slots: int, seconds: float, decoding: bool, tokens: int, policy, queue_depth: int,
             arm=None, prefix_tokens: int = 0):
        """After each engine iteration (the engine thread); ``arm``: the policy's choice for the step's rows
        that named no tau (None: there were none)."""
        self.steps.inc()
        if arm is not None:
            self.policy_steps.labels(arm_label(arm)).inc()
        self.tokens.inc(tokens)
        self.prefix_tokens.inc(prefix_tokens)
        self.step_seconds.observe(seconds)
        if not decoding:
            self.joining_seconds.inc(seconds)
        self.queue_depth.set(queue_depth)
        self._policy = policy  # its tau and tokens/forward are read when /metrics is scraped (render)
        if decoding and getattr(policy, "cost", None) is None:  # a policy that keeps no costs: the last step's
            self.step_cost.labels(str(rows), str(slots)).set(seconds)

    def set_release(self, name: str, version: str | None, previous: tuple[str, str | None] | None = None):
        if previous is not None and previous != (name, version):
            try:
                self.release.remove(previous[0], previous[1] or "")
            except KeyError:
                pass
        self.release.labels(name, version or "").set(1)

    def render(self, queue_depth: int, running: int) -> bytes:
        self.queue_depth.set(queue_depth)
        self.running.set(running)
        policy = self._policy
        if policy is not None:
            self.tau.set(policy.tau)
            self.lossless.set(is_lossless(getattr(policy, "arm", None)))
            for tau in list(getattr(policy, "tpf", ())):  # a copy: the engine thread writes it
                value = policy.tokens_per_forward(tau)  # the estimate the policy decides on
                if value is not None:
                    self.tokens_per_forward.labels(arm_label(tau)).set(value)
            for (rows, slots), seconds in list(getattr(policy, "cost", {}).items()):  # the medians it decides on
                self.step_cost.labels(str(rows), str(slots)).set(seconds)
            for rows, seconds in list(getattr(policy, "prompt_token_cost", {}).items()):
                self.prompt_token_cost.labels(str(rows)).set(seconds)
        return generate_latest(self.registry)


def arm_label(arm) -> str:
    """A tau as Prometheus label text ("0.9", "1"), or "lossless"."""
    return arm if isinstance(arm, str) else f"{arm:g}"
