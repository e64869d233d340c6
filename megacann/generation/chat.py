"""A conversation with a model: each user turn is rendered, with every turn before it, by a chat template
(the SFT templates of :mod:`megacann.data.sft_templates`, given by the caller), the model's answer is
streamed as its tokens are chosen, and the answer joins the conversation for the next turn.

An answer ends at EOS, at its ``max_new_tokens``, at a stop string of the sampling params, or where the
template closes an assistant turn (its ``assistant_suffix``, e.g. ChatML's ``<|im_end|>``); the text kept
is cut before the stop. Each turn runs the whole conversation again as its prompt (no cache is kept
between turns).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Optional, TextIO

from megacann.generation.generator import Generator
from megacann.generation.sampling import SamplingParams
from megacann.generation.stops import StopStrings

EXIT = "/exit"


class ChatSession:
    """The conversation so far (``messages``: role/content dicts, as the SFT data holds them) and what
    answers in it. ``template`` renders a conversation (``render(messages)`` -> ``(text, trained)``
    segments, and ``assistant_suffix``); ``encode`` turns the rendered text into token ids."""

    def __init__(
        self,
        generator: Generator,
        tokenizer: Any,
        template: Any,
        params: SamplingParams,
        encode: Optional[Callable[[str], list[int]]] = None,
        system: Optional[str] = None,
    ):
        self.generator, self.tokenizer, self.template = generator, tokenizer, template
        suffix = (template.assistant_suffix,) if template.assistant_suffix else ()
        self.params = dataclasses.replace(params, stop=tuple(dict.fromkeys(params.stop + suffix)))
        self.encode = encode or tokenizer.encode
        self.messages: list[dict] = [{"role": "system", "content": system}] if system else []
        self.prompts: list[str] = []  # the rendered prompt of each turn

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

        self.generator.generate([self.encode(text)], self.params, on_token=show, stop_check=stops)
        out.write(stops.rest(0) + "\n")
        out.flush()
        answer = stops.text(0)
        self.messages += [{"role": "user", "content": user}, {"role": "assistant", "content": answer}]
        return answer


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
