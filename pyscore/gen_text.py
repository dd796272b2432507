"""The stop-string and streaming text rule of a generation, stated once here; no model, no torch.

Generation ends at the first occurrence of any stop string in the generated text: `text` is everything before it
(the stop string is not included; `matched` says which one: the earliest, the first listed of those found at the
same character); `token_ids` and `logprobs` are the fewest generated tokens whose text covers `text` — the last one
may reach into the stop string, none begins at or after it. (An end-of-sequence token, or a stop_token_ids entry,
never reaches this record: the sequence ends before it.) Streamed chunks carry exactly these tokens and this text,
in order, and each chunk's text is what its tokens add (a token is held back until its text is final: not an
incomplete UTF-8 character, and not possibly the start of a stop string), except that the last chunk of a stopped
generation ends its text at the stop.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from pyscore.types import TokenLogprob


@dataclass
class StopText:
    """A generation's emitted tokens and text under the stop-string rule, and what of them has been streamed."""

    stop: Sequence[str]
    tokenizer: Any
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    text: str = ""
    matched: str | None = None  # the stop string the text was cut at
    _covers: list[int] = field(default_factory=list)  # [i]: characters of text final after token_ids[: i + 1]
    _whole: list[bool] = field(default_factory=list)  # [i]: token_ids[: i + 1] ends on a whole character
    _sent_tokens: int = 0
    _sent_chars: int = 0

    def add(self, token: int, logprob: TokenLogprob) -> bool:
        """Appends a generated token; True when the text now contains a stop string (and was cut before it)."""
        self.token_ids.append(token)
        self.logprobs.append(logprob)
        self.text = self.tokenizer.decode(self.token_ids, skip_special_tokens=True)
        final = self.text.rstrip("\ufffd")  # an incomplete UTF-8 tail is not final yet
        self._covers.append(len(final))
        self._whole.append(len(final) == len(self.text))
        found = [(at, k) for k, at in enumerate(self.text.find(s) for s in self.stop) if at >= 0]
        if not found:
            return False
        cut, k = min(found)
        self.matched = self.stop[k]
        self._stop_at(cut)
        return True

    def _stop_at(self, cut: int) -> None:
        """Ends the text at character `cut` and keeps the fewest tokens that cover it."""
        keep = bisect.bisect_left(self._covers, cut) + 1 if cut else 0
        del self.token_ids[keep:], self.logprobs[keep:], self._covers[keep:], self._whole[keep:]
        self.text = self.text[:cut]

    def take_delta(self, finished: bool) -> tuple[list[int], list[TokenLogprob], str]:
        """The tokens, their logprobs and the text that became final since the last call: tokens that end on a
        whole character before the last (longest stop - 1) characters, which might begin a stop string; once
        the generation has `finished`, everything left."""
        if finished:
            tokens, chars = len(self.token_ids), len(self.text)
        else:
            hold = max((len(s) - 1 for s in self.stop), default=0)
            tokens = bisect.bisect_right(self._covers, self._covers[-1] - hold) if self._covers else 0
            while tokens > self._sent_tokens and not self._whole[tokens - 1]:
                tokens -= 1
            tokens = max(tokens, self._sent_tokens)
            chars = self._covers[tokens - 1] if tokens else 0
        delta = (self.token_ids[self._sent_tokens : tokens], self.logprobs[self._sent_tokens : tokens],
                 self.text[self._sent_chars : chars])
        self._sent_tokens, self._sent_chars = tokens, chars
        return delta
