"""Token ids -> text, as deltas while a request streams and whole at its end, with stop strings cut off.

The decoder ends a row at the token whose text completes a stop string (:mod:`mars.decoding.stop_strings`);
the text returned ends before the stop string, as OpenAI's does. While streaming, the last
``len(longest stop) - 1`` characters are held back (they may start a stop string), so the deltas joined
are exactly the non-streaming text.

Streaming decodes incrementally, as HF's ``TextStreamer`` and vLLM's detokenizer do: each push decodes
only the new tokens with a few tokens before them for context (a tokenizer may render a token
differently at the start of a text: a leading space, a byte of a multi-byte character) and takes the
difference, so a response of n tokens costs O(n) decoding, not O(n^2). New tokens that end inside a
UTF-8 character (the text ends in U+FFFD) wait for the next push. The stop strings are looked for in
the new text and the characters before it that a stop string could span.
"""

from __future__ import annotations

from typing import Sequence

REPLACEMENT = "\ufffd"


class TextStream:
    def __init__(self, tokenizer, stop: Sequence[str] = ()):
        self.tokenizer, self.stop = tokenizer, [s for s in stop if s]
        self.hold = max((len(s) for s in self.stop), default=1) - 1
        self.token_ids: list[int] = []
        self.decoded = ""  # the text of token_ids[:read], grown by push
        self.prefix = 0  # token_ids[prefix:read]: the context the next new tokens are decoded after
        self.read = 0
        self.cut: int | None = None  # where the first stop string starts in `decoded`
        self.searched = 0  # `decoded[:searched]` holds no stop string's start that could end there
        self.sent = 0  # characters of `decoded` streamed so far

    def _decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def _cut(self, text: str) -> str:
        cuts = [text.find(s) for s in self.stop if s in text]
        return text[: min(cuts)] if cuts else text

    def text(self) -> str:
        """The whole text of every token so far, cut before the first stop string (one full decode)."""
        return self._cut(self._decode(self.token_ids))

    def push(self, token_ids: Sequence[int]) -> str:
        """Add accepted tokens; returns the text that is now safe to send."""
        self.token_ids.extend(token_ids)
        if self.cut is None:
            before = self._decode(self.token_ids[self.prefix: self.read])
            after = self._decode(self.token_ids[self.prefix:])
            if len(after) > len(before) and not after.endswith(REPLACEMENT):
                if after.startswith(before):
                    self.decoded += after[len(before):]
                else:  # the context decoded differently with the new tokens after it: take the whole text
                    self.decoded = self._decode(self.token_ids)
                self.prefix, self.read = self.read, len(self.token_ids)
                self._find_stop()
        end = self.cut if self.cut is not None else len(self.decoded) - self.hold
        if end <= self.sent:
            return ""
        delta, self.sent = self.decoded[self.sent: end], end
        return delta

    def _find_stop(self) -> None:
        start = max(0, self.searched - self.hold)
        found = [i for i in (self.decoded.find(s, start) for s in self.stop) if i >= 0]
        if found:
            self.cut = min(found)
        self.searched = len(self.decoded)

    def finish(self) -> str:
        """The rest of the text, once the request is done: the whole text decoded once, less what was sent
        (incremental and whole decoding agree on the tokenizers we serve; were they ever to differ, what
        was sent stands)."""
        text = self.text()
        delta = text[self.sent:] if text.startswith(self.decoded[: self.sent]) else ""
        self.sent = max(self.sent, len(text))
        return delta
