"""``/metrics``: the server's state in Prometheus text format (prometheus-client, one registry per server).

What an operator (and the HorizontalPodAutoscaler, through the Prometheus adapter) reads:
``mars_queue_depth`` (requests waiting for a batch row), ``mars_running_requests``, the tau policy's
decision (``mars_tau_in_use``, ``mars_lossless_in_use``, ``mars_setting_in_use{setting}``) and what it
decides on (``mars_step_cost_seconds{batch, window}``: the measured step cost by batch-size bucket and
window slots; ``mars_tokens_per_forward{setting}``: tokens per row and step), ``mars_policy_steps_total
{setting}`` (where the policy spends its steps), ``mars_prefix_cache_tokens_total`` (prompt tokens copied
from the prefix cache instead of computed), counters of requests by status, generated tokens and decoding
steps, a step-time histogram, ``mars_joining_step_seconds_total`` (the part of it in steps that took new
requests' prompts: prefill beside the batch's decoding), and ``mars_release_info`` (which release serves
new requests). The policy's numbers come from the immutable snapshot it publishes, read at scrape time.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest



class ServerMetrics:
    def __init__(self):
        self.registry = registry = CollectorRegistry()
        self._policy = None  # the tau policy of the last engine step
        self.queue_depth = Gauge("mars_queue_depth", "requests waiting for a batch row", registry=registry)
        self.running = Gauge("mars_running_requests", "requests decoding in the batch", registry=registry)
        self.tau = Gauge("mars_tau_in_use", "the tau policy's tau (rows that named no setting)", registry=registry)
        self.lossless = Gauge("mars_lossless_in_use", "1 while the tau policy decodes rows in the lossless mode",
                              registry=registry)
        self.setting = Gauge("mars_setting_in_use", "1 for the tau policy's setting", ["setting"], registry=registry)
        self.step_cost = Gauge("mars_step_cost_seconds", "measured seconds per decoding step (moving average)",
                               ["batch", "window"], registry=registry)
        self.tokens_per_forward = Gauge("mars_tokens_per_forward", "measured tokens per row and step in a setting",
                                        ["setting"], registry=registry)
        self.requests = Counter("mars_requests", "finished HTTP generation requests", ["status"], registry=registry)
        self.tokens = Counter("mars_generated_tokens", "tokens generated", registry=registry)
        self.steps = Counter("mars_decoding_steps", "batched decoding forwards", registry=registry)
        self.prefix_tokens = Counter("mars_prefix_cache_tokens", "prompt tokens copied from the prefix cache (the "
                                     "chat template's head) instead of computed", registry=registry)
        self.policy_steps = Counter("mars_policy_steps", "decoding steps by the setting the tau policy chose for "
                                    "the rows that named none", ["setting"], registry=registry)
        self.joining_seconds = Counter("mars_joining_step_seconds", "seconds in steps that took new requests' "
                                       "prompts (their prefill beside the batch's decoding)", registry=registry)
        self.step_seconds = Histogram("mars_step_seconds", "seconds per batched decoding step", registry=registry,
                                      buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5))
        self.release = Gauge("mars_release_info", "1 for the release serving new requests", ["name", "version"],
                             registry=registry)
        self.swap_failures = Counter("mars_release_load_failures", "releases that failed to load (the old kept "
                                     "serving)", registry=registry)

    def step(self, seconds: float, decoding: bool, tokens: int, queue_depth: int, setting: str | None = None,
             prefix_tokens: int = 0):
        """After each engine iteration (the engine thread); ``setting``: the label of the policy's choice for
        the step's rows that named none (None: there were none)."""
        self.steps.inc()
        if setting is not None:
            self.policy_steps.labels(setting).inc()
        self.tokens.inc(tokens)
        self.prefix_tokens.inc(prefix_tokens)
        self.step_seconds.observe(seconds)
        if not decoding:
            self.joining_seconds.inc(seconds)
        self.queue_depth.set(queue_depth)

    def set_release(self, name: str, version: str | None, previous: tuple[str, str | None] | None = None):
        if previous is not None and previous != (name, version):
            try:
                self.release.remove(previous[0], previous[1] or "")
            except KeyError:
                pass
        self.release.labels(name, version or "").set(1)

    def render(self, queue_depth: int, running: int, policy=None, block_size: int | None = None) -> bytes:
        """The registry as text; ``policy``'s numbers from its current snapshot."""
        self.queue_depth.set(queue_depth)
        self.running.set(running)
        if policy is not None:
            snap = policy.snapshot
            self.tau.set(snap.setting.tau)
            self.lossless.set(snap.setting.lossless)
            self.setting.clear()
            self.setting.labels(snap.setting.label(block_size)).set(1)
            for setting, tokens in snap.tokens_per_step.items():
                self.tokens_per_forward.labels(setting.label(block_size)).set(tokens)
            for (rows, slots), seconds in snap.step_cost.items():
                self.step_cost.labels(str(rows), str(slots)).set(seconds)
        return generate_latest(self.registry)
