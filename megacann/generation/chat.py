"""A conversation with a model: each user turn is rendered, with every turn before it, by a chat template
(the SFT templates of :mod:`megacann.data.sft_templates`, given by the caller), the model's answer is
streamed as its tokens are chosen, and the answer joins the conversation for the next turn.

An answer ends at EOS, at its ``max_new_tokens``, at a stop string of the sampling params, or where the
template closes an assistant turn (its ``assistant_suffix``, e.g. ChatML's ``<|im_end|>``); the text kept
is cut before the stop.

With ``cache_len`` the conversation's cache is kept across turns: a turn runs only the text the template
adds after what the cached tokens stand for (the prompt, the answer as generated, e.g. with the
``<|im_end|>`` that stopped it, then the next user turn), after the previous answer's last token; its tokens
equal a run of all the conversation's tokens from scratch. An answer ended by EOS stands for the
template's end of the answer. Where the cache would overflow, or the rendered conversation no longer
continues the cached text (an answer cut at another stop string), one line says so and the turn runs the
whole conversation again. Every built-in cache kind is kept: keys and values, rolling windows (the turn's
tokens continue the window), latent caches, Gated DeltaNet's state (the cache holds it after every token
but the last one chosen, which the turn feeds first) and DeepSeek-V4's compressed windows. Without
``cache_len`` (or for a registered cache layer that cannot take several tokens after cached ones) every turn
runs the whole conversation.
"""

from __future__ import annotations

import dataclasses
import sys
from typing import Any, Callable, Optional, TextIO

from megacann.generation.generator import GenerationResult, Generator
from megacann.generation.kv_cache import KVCache
from megacann.generation.sampling import SamplingParams
from megacann.generation.stops import StopStrings

EXIT = "/exit"


class ChatSession:
    """The conversation so far (``messages``: role/content dicts, as the SFT data holds them) and what
    answers in it. ``template`` renders a conversation (``render(messages)`` -> ``(text, trained)``
    segments, and ``assistant_suffix``); ``encode`` turns the rendered text into token ids (the new part of
    a turn: the tokenizer's ``encode``). ``cache_len``: the tokens of the cache kept across turns (None:
    none kept); ``notice`` says why a turn runs the whole conversation again."""

    def __init__(
        self,
        generator: Generator,
        tokenizer: Any,
        template: Any,
        params: SamplingParams,
        encode: Optional[Callable[[str], list[int]]] = None,
        system: Optional[str] = None,
        cache_len: Optional[int] = None,
        notice: Optional[Callable[[str], None]] = None,
    ):
        self.generator, self.tokenizer, self.template = generator, tokenizer, template
        suffix = (template.assistant_suffix,) if template.assistant_suffix else ()
        self.params = dataclasses.replace(params, stop=tuple(dict.fromkeys(params.stop + suffix)))
        self.encode = encode or tokenizer.encode
        self.messages: list[dict] = [{"role": "system", "content": system}] if system else []
        self.prompts: list[str] = []  # the rendered prompt of each turn
        self.notice = notice or (lambda line: print(line, file=sys.stderr))
        self.cache_len = cache_len
        if cache_len is not None and not generator.new_cache(cache_len).extendable:
            self.notice("the model's cache cannot be kept across turns: each turn runs the whole conversation")
            self.cache_len = None
        self.cache: Optional[KVCache] = None
        self.tokens: list[int] = []  # the conversation's tokens so far: the cache's, then the last one chosen
        self.covered = ""  # the rendered text those tokens stand for

    def prompt(self, user: str) -> str:
        """The text the model continues when the user says ``user`` now."""
        segments = self.template.render([*self.messages, {"role": "user", "content": user}])
        return "".join(text for text, _ in segments)

    def reply(self, user: str, out: TextIO) -> str:
        """The model's answer to ``user``, written to ``out`` as it is generated (then a newline), and
        kept in the conversation."""
        text = self.prompt(user)
        self.prompts.append(text)
        stops = StopStrings(self.tokenizer, [self.params.stop], skip=self.generator.eos_token_ids)

        def show(request: int, token: int) -> None:
            out.write(stops.stream(request))
            out.flush()

        result = self._answer(text, show, stops)
        out.write(stops.rest(0) + "\n")
        out.flush()
        answer = stops.text(0)
        if self.cache is not None:
            self._remember(text, result)
        self.messages += [{"role": "user", "content": user}, {"role": "assistant", "content": answer}]
        return answer

    def _answer(self, text: str, show: Callable[[int, int], None], stops: StopStrings) -> GenerationResult:
        """The turn's result: continuing the kept cache where the rendered ``text`` continues its tokens
        and they fit, else from the whole conversation (into a new kept cache where it fits)."""
        feed = self._continuation(text) if self.cache is not None else None
        if feed is None:
            feed, self.tokens = self.encode(text), []
            self.cache = self.generator.new_cache(self.cache_len) if self.cache_len is not None else None
        length = self.cache.length if self.cache is not None else 0
        if self.cache is not None and length + len(feed) + self.params.max_new_tokens - 1 > self.cache_len:
            self.notice(
                f"the conversation ({length + len(feed)} tokens, up to {self.params.max_new_tokens} more) "
                f"outgrows the chat cache of {self.cache_len} tokens: this turn runs the whole conversation"
            )
            feed, self.tokens, self.cache = self.encode(text), [], None
        if self.cache is None:
            (result,) = self.generator.generate([feed], self.params, on_token=show, stop_check=stops)
        else:
            result = self.generator.extend(self.cache, feed, self.params, on_token=show, stop_check=stops)
        self.tokens += feed[1:] if self.tokens else feed  # a continuation's first token is the last one chosen
        return result

    def _continuation(self, text: str) -> Optional[list[int]]:
        """The tokens a turn whose rendered prompt is ``text`` runs after the kept cache (the last chosen
        token, then the text after what the tokens so far stand for); None where ``text`` does not
        continue that text (one line said)."""
        if not text.startswith(self.covered):
            self.notice("the conversation no longer continues the cached tokens: this turn runs it whole")
            return None
        return [self.tokens[-1], *self.tokenizer.encode(text[len(self.covered) :])]

    def _remember(self, text: str, result: GenerationResult) -> None:
        """Keep the turn's generated tokens and the text they stand for: as decoded, and an EOS closes
        the answer as the template does."""
        eos = self.generator.eos_token_ids
        self.tokens += result.tokens
        self.covered = text + self.tokenizer.decode([t for t in result.tokens if t not in eos])
        if result.finish_reason == "eos":
            self.covered += self.template.assistant_suffix


def chat(session: ChatSession, lines: TextIO, out: TextIO, prompt_marker: str = "") -> int:
    """Answer each line of ``lines`` until ``/exit`` or the end of input; the number of turns answered.
    ``prompt_marker`` is written before each user line is read (on a terminal)."""
    turns = 0
    while True:
        out.write(prompt_marker)
        out.flush()
        line = lines.readline()
        if not line or line.strip() == EXIT:
            return turns
        if line.strip():
            session.reply(line.rstrip("\n"), out)
            turns += 1
