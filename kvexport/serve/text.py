# SPDX-License-Identifier: Apache-2.0
"""Generated token ids -> the text a client sees, in pieces, with ``stop`` strings cut out.

Decoding is incremental (the way text-generation servers do it): each new token decodes together with the few
tokens before it, and the piece that is new is kept only once it no longer ends in an incomplete UTF-8 sequence
(U+FFFD). Stop strings follow OpenAI's rule: the text ends just before the first occurrence of any of them, which
is not returned. Until a stop string can no longer begin inside it, the last ``max(len(stop)) - 1`` characters are
held back, so a streamed client never receives text that a stop string later takes back.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class TextStream:
    """Feed token ids with :meth:`push`; each call returns the text that is safe to send now."""

    tokenizer: object
    stop: tuple[str, ...] = ()
    ids: list[int] = field(default_factory=list)
    text: str = ""  # everything decoded so far
    sent: int = 0  # characters of ``text`` returned so far
    stopped: bool = False  # a stop string was found: nothing more is returned
    _prefix: int = 0  # ids[_prefix:_read] decode to the context of the next piece
    _read: int = 0

    def push(self, token: int) -> str:
        """Add one token; returns the new text that can be sent (possibly empty)."""
        if self.stopped:
            return ""
        self.ids.append(int(token))
        before = self._decode(self.ids[self._prefix:self._read])
        now = self._decode(self.ids[self._prefix:])
        if len(now) > len(before) and not now.endswith("\ufffd"):
            self.text += now[len(before):]
            self._prefix, self._read = self._read, len(self.ids)
        return self._release(final=False)

    def finish(self) -> str:
        """The text held back (no more tokens come)."""
        if not self.stopped and self._read < len(self.ids):  # an incomplete character at the very end
            tail = self._decode(self.ids[self._prefix:])[len(self._decode(self.ids[self._prefix:self._read])):]
            self.text += tail
            self._read = len(self.ids)
        return self._release(final=True)

    def _release(self, final: bool) -> str:
        if self.stop:
            longest = max(len(s) for s in self.stop)
            start = max(0, self.sent - longest)
            hits = [i for i in (self.text.find(s, start) for s in self.stop) if i >= 0]
            if hits:
                self.stopped = True
                end = min(hits)
                piece = self.text[self.sent:end] if end > self.sent else ""
                self.text = self.text[:end]
                self.sent = len(self.text)
                return piece
            hold = 0 if final else longest - 1
        else:
            hold = 0
        upto = max(self.sent, len(self.text) - hold)
        piece = self.text[self.sent:upto]
        self.sent = upto
        return piece

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True) if ids else ""


__all__ = ["TextStream"]
