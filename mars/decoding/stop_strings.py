"""Stop strings: end a sequence at the token whose text completes one (lm-eval's ``until``).

A stop string may span several tokens, or be part of one, so it is looked for in decoded text: after
each step, a row's newly accepted tokens are decoded one by one together with a few tokens before them
(as many as the longest stop string takes, plus two, as lm-eval's ``hf`` model looks back), and the
row ends after the first token whose text completes a stop string; tokens accepted past it in the same
step are dropped. The caller still cuts the text at the stop string, as lm-eval does: what this saves is
the decoding past it.
"""

from __future__ import annotations

from typing import Sequence


class StopStrings:
    def __init__(self, tokenizer, strings: Sequence[str]):
        self.strings = [s for s in strings if s]
        if self.strings and tokenizer is None:
            raise ValueError("stop strings need a tokenizer")
        self.tokenizer = tokenizer
        self.lookback = max((len(tokenizer.encode(s, add_special_tokens=False)) for s in self.strings), default=0) + 2

    def __bool__(self) -> bool:
        return bool(self.strings)

    def cut(self, generated: Sequence[int], new: int) -> int | None:
        """How many of ``generated`` to keep when one of its last ``new`` tokens completes a stop string
        (the tokens up to and with that one), else None."""
        first_new = len(generated) - new
        start = max(0, first_new - self.lookback)
        for end in range(first_new + 1, len(generated) + 1):
            text = self.tokenizer.decode(list(generated[start:end]), skip_special_tokens=False)
            if any(s in text for s in self.strings):
                return end
        return None
