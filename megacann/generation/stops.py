"""Stop strings: a request ends when the text it generated contains one of its ``stop`` strings, and its
text is cut before it.

Token ids do not map one to one onto characters (a byte-level BPE may split a character over tokens, a
SentencePiece token's leading space depends on the token before), so each request's text is decoded as it
grows, a few tokens at a time: :class:`IncrementalText` decodes only the tokens since the last complete
character, with the ones just before as context, and a step whose text ends in an unfinished character
(U+FFFD) waits for the next token. The search for a stop string looks only at the new text and the
``len(longest stop) - 1`` characters before it, so a step costs the same early and late in a response.

The same object streams a response (:meth:`StopStrings.stream`): it hands out new text except a tail
that could still become a stop string, and never the stop string itself.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any, Optional

UNFINISHED = "\ufffd"  # what a decoder gives for the first bytes of a character not yet complete


class IncrementalText:
    """The text of a growing list of tokens (``skip``: ids that add no text, e.g. EOS), decoded a few tokens
    at a time: ``decode(tokens[context:])`` less ``decode(tokens[context:done])``."""

    def __init__(self, tokenizer: Any, skip: Iterable[int] = ()):
        self.tokenizer, self.skip = tokenizer, set(skip)
        self.tokens: list[int] = []
        self.text = ""
        self._context = 0  # first token decoded with the new ones (for their leading spaces)
        self._done = 0  # tokens whose text is in self.text

    def push(self, token: int) -> str:
        """Add ``token``; return the text it completed (empty while a character is unfinished)."""
        if token in self.skip:
            return ""
        self.tokens.append(token)
        return self._catch_up(final=False)

    def finish(self) -> str:
        """The text of tokens still held back (an unfinished character at the end), added now."""
        return self._catch_up(final=True)

    def _catch_up(self, final: bool) -> str:
        if self._done == len(self.tokens):
            return ""
        before = self.tokenizer.decode(self.tokens[self._context : self._done])
        now = self.tokenizer.decode(self.tokens[self._context :])
        if not final and (len(now) <= len(before) or now.endswith(UNFINISHED)):
            return ""
        new = now[len(before) :]
        self.text += new
        self._context, self._done = self._done, len(self.tokens)
        return new


def check_stop(stop: Any) -> tuple[str, ...]:
    """The stop strings of ``stop`` (a string, or a list of strings); ValueError naming the option."""
    if stop is None:
        return ()
    strings = (stop,) if isinstance(stop, str) else stop
    if not isinstance(strings, (list, tuple)) or not all(isinstance(s, str) for s in strings):
        raise ValueError(
            f"sampling option stop must be a string or a list of strings, got {stop!r} ({type(stop).__name__})"
        )
    if any(not s for s in strings):
        raise ValueError("sampling option stop: a stop string must not be empty")
    return tuple(strings)


class StopStrings:
    """The text and stop strings of each request of one ``Generator.generate`` call (``stops[i]``: request
    ``i``'s). Called as the generator's ``stop_check`` with each chosen token; True once the request's text
    holds a stop string."""

    def __init__(self, tokenizer: Any, stops: Sequence[Sequence[str]], skip: Iterable[int] = ()):
        skip = set(skip)
        self.stops = [tuple(s) for s in stops]
        self.texts = [IncrementalText(tokenizer, skip) for _ in self.stops]
        self.cut: list[Optional[int]] = [None] * len(self.stops)  # where each found stop string begins
        self._streamed = [0] * len(self.stops)

    def __call__(self, request: int, token: int) -> bool:
        text, stops = self.texts[request], self.stops[request]
        if self.cut[request] is not None:
            return True
        searched = len(text.text)
        if not text.push(token) or not stops:
            return False
        start = max(0, searched - max(map(len, stops)) + 1)
        found = [at for at in (text.text.find(s, start) for s in stops) if at >= 0]
        if found:
            self.cut[request] = min(found)
        return bool(found)

    def text(self, request: int) -> str:
        """Request ``request``'s text so far, cut before its stop string (when one was found)."""
        cut = self.cut[request]
        if cut is None:
            self.texts[request].finish()
        text = self.texts[request].text
        return text if cut is None else text[:cut]

    def stream(self, request: int) -> str:
        """The text not handed out before that is safe to show: nothing from a found stop string on, and
        not the tail that could still grow into one."""
        text, cut = self.texts[request].text, self.cut[request]
        end = cut if cut is not None else len(text) - self._held_back(request)
        new = text[self._streamed[request] : end]
        self._streamed[request] = max(self._streamed[request], end)
        return new

    def rest(self, request: int) -> str:
        """The rest of the text to show once the request ended (the held-back tail, if no stop was found)."""
        final = self.text(request)
        new = final[self._streamed[request] :]
        self._streamed[request] = len(final)
        return new

    def _held_back(self, request: int) -> int:
        """Characters at the end of the text that begin some stop string of the request."""
        text = self.texts[request].text
        held = 0
        for stop in self.stops[request]:
            for length in range(min(len(stop) - 1, len(text)), held, -1):
                if text.endswith(stop[:length]):
                    held = length
                    break
        return held
