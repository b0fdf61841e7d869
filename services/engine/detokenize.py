"""Incremental detokenisation of a generated stream, with stop strings matched on the text.

Design decisions:

- Bytes, then text: each token contributes its bytes (``tokenizer.token_bytes``) to an incremental UTF-8
  decoder, so a character split across tokens is released only once it is complete, and the concatenation of
  the streamed deltas equals ``tokenizer.decode(ids)`` of the whole output (up to a stop string).
- Stop strings are matched on the decoded text, not on token ids: a stop string may start or end inside a
  token. When one matches, the text ends right before it (the stop string and anything after it are never
  sent); the token ids that produced it are still reported, since they were generated.
- To never send text that a later token turns into a stop string, the longest tail of the text that is a
  prefix of some stop string is held back until it either completes a match or can no longer do so.
- A model whose vocabulary is padded beyond the tokenizer's (ids the tokenizer has no bytes for) yields
  U+FFFD for such ids, the same replacement used for invalid UTF-8.
"""

from __future__ import annotations

import codecs
from collections.abc import Sequence
from typing import Protocol

REPLACEMENT = "\ufffd".encode()


class Tokenizer(Protocol):
    """What detokenisation needs from a ``k3.model.tokenizer`` tokenizer."""

    @property
    def vocab_size(self) -> int: ...

    def token_bytes(self, token_id: int) -> bytes: ...


class TextStream:
    """Turns generated token ids into text deltas and reports when a stop string appears."""

    def __init__(self, tokenizer: Tokenizer, stop: Sequence[str] = ()):
        self._tokenizer = tokenizer
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._stop = tuple(stop)
        self._text = ""
        self._sent = 0
        self.stopped = False
        """True once a stop string matched (no more text will ever be released)."""

    @property
    def text(self) -> str:
        """Everything released so far."""
        return self._text[: self._sent]

    def _bytes(self, token_id: int) -> bytes:
        if 0 <= token_id < self._tokenizer.vocab_size:
            return self._tokenizer.token_bytes(token_id)
        return REPLACEMENT

    def push(self, token_id: int) -> str:
        """Add one generated token; return the text that can be released now ("" after a stop)."""
        if self.stopped:
            return ""
        search_from = max(0, len(self._text) - max((len(s) for s in self._stop), default=0) + 1)
        self._text += self._decoder.decode(self._bytes(token_id))
        match = self._find_stop(search_from)
        if match is not None:
            self.stopped = True
            return self._release(match)
        return self._release(len(self._text) - self._held_back())

    def finish(self) -> str:
        """End of generation: release whatever was held back (incomplete UTF-8 becomes U+FFFD)."""
        if self.stopped:
            return ""
        self._text += self._decoder.decode(b"", final=True)
        match = self._find_stop(0)
        if match is not None:
            self.stopped = True
            return self._release(match)
        return self._release(len(self._text))

    def _find_stop(self, start: int) -> int | None:
        hits = [i for i in (self._text.find(s, start) for s in self._stop) if i != -1]
        return min(hits) if hits else None

    def _held_back(self) -> int:
        """Length of the longest tail of the text that could still grow into a stop string."""
        longest = 0
        for s in self._stop:
            for n in range(min(len(s) - 1, len(self._text)), longest, -1):
                if self._text.endswith(s[:n]):
                    longest = n
                    break
        return longest

    def _release(self, end: int) -> str:
        end = max(end, self._sent)
        delta = self._text[self._sent:end]
        self._sent = end
        if self.stopped:
            self._text = self._text[:end]
        return delta
