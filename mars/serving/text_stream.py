"""Token ids -> text, as deltas while a request streams and whole at its end, with stop strings cut off.

The decoder ends a row at the token whose text completes a stop string (:mod:`mars.decoding.stop_strings`);
the text returned ends before the stop string, as OpenAI's does. While streaming, the last
``len(longest stop) - 1`` characters and an incomplete UTF-8 character (a trailing U+FFFD) are held
back, so the deltas joined are exactly the non-streaming text.
"""

from __future__ import annotations

from typing import Sequence


class TextStream:
    def __init__(self, tokenizer, stop: Sequence[str] = ()):
        self.tokenizer, self.stop = tokenizer, [s for s in stop if s]
        self.hold = max((len(s) for s in self.stop), default=1) - 1
        self.token_ids: list[int] = []
        self.emitted = ""

    def _decoded(self) -> str:
        return self.tokenizer.decode(self.token_ids, skip_special_tokens=True)

    def text(self) -> str:
        """The whole text so far, cut before the first stop string."""
        text = self._decoded()
        cuts = [text.find(s) for s in self.stop if s in text]
        return text[: min(cuts)] if cuts else text

    def push(self, token_ids: Sequence[int]) -> str:
        """Add accepted tokens; returns the text that is now safe to send."""
        self.token_ids.extend(token_ids)
        text = self.text()
        safe = text[: len(text) - self.hold] if self.hold else text
        safe = safe.rstrip("\ufffd")
        if len(safe) <= len(self.emitted) or not safe.startswith(self.emitted):
            return ""
        delta, self.emitted = safe[len(self.emitted):], safe
        return delta

    def finish(self) -> str:
        """The rest of the text, once the request is done."""
        text = self.text()
        delta = text[len(self.emitted):] if text.startswith(self.emitted) else ""
        self.emitted = text
        return delta
