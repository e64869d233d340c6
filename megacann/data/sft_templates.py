"""Prompt templates for supervised fine-tuning: how a conversation becomes text.

A rendered sample is a list of ``(text, trained)`` segments; ``trained`` is True only for the assistant's
answers (and the suffix that ends them), so prompt tokens get no loss. ``data.prompt_template`` is one of
the names in :data:`TEMPLATES`, or a custom string holding ``{instruction}`` (and optionally ``{input}``)
that becomes the prompt; the answer follows it directly.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional


@dataclass(frozen=True)
class PromptTemplate:
    name: str
    default_system: str = ""  # used when the sample brings no system message
    system_format: str = "{content}"
    user_format: str = "{content}"
    assistant_prefix: str = ""  # prompt side: opens the answer
    assistant_suffix: str = ""  # trained: closes the answer
    turn_separator: str = ""  # prompt side: before every user turn but the first
    input_format: str = "{instruction}\n\n{input}"  # instruction + input -> the user turn
    input_always: bool = False  # apply input_format even when the input is empty (custom templates)

    def user_content(self, instruction: str, input_text: str) -> str:
        if not input_text and not self.input_always:
            return instruction
        return self.input_format.replace("{instruction}", instruction).replace("{input}", input_text)

    def render(self, messages: list[dict]) -> list[tuple[str, bool]]:
        """Segments of a conversation: ``messages`` are {role: system|user|assistant, content} dicts (a user
        message may carry an ``input``), already checked (see :func:`megacann.data.sft.parse_record`)."""
        segments: list[tuple[str, bool]] = []
        system = self.default_system
        if messages and messages[0]["role"] == "system":
            system, messages = messages[0]["content"], messages[1:]
        if system:
            segments.append((self.system_format.replace("{content}", system), False))
        first_user = True
        for message in messages:
            if message["role"] == "user":
                separator = "" if first_user else self.turn_separator
                content = self.user_content(message["content"], message.get("input", ""))
                text = separator + self.user_format.replace("{content}", content)
                segments.append((text + self.assistant_prefix, False))
                first_user = False
            else:
                segments.append((message["content"] + self.assistant_suffix, True))
        return segments


TEMPLATES: dict[str, PromptTemplate] = {
    "alpaca": PromptTemplate(
        name="alpaca",
        default_system="The text below is a task instruction. Write a response that completes it.\n\n",
        user_format="### Instruction:\n{content}\n\n",
        assistant_prefix="### Response:\n",
        turn_separator="\n\n",
        input_format="{instruction}\n\n### Input:\n{input}",
    ),
    "chatml": PromptTemplate(
        name="chatml",
        system_format="<|im_start|>system\n{content}<|im_end|>\n",
        user_format="<|im_start|>user\n{content}<|im_end|>\n",
        assistant_prefix="<|im_start|>assistant\n",
        assistant_suffix="<|im_end|>",
        turn_separator="\n",
    ),
    "plain": PromptTemplate(name="plain", user_format="{content}\n", turn_separator="\n"),
}


def get_template(spec: Optional[str]) -> PromptTemplate:
    """A named template, or a custom one from a string containing ``{instruction}``."""
    spec = spec or "alpaca"
    if spec in TEMPLATES:
        return TEMPLATES[spec]
    if "{instruction}" not in spec:
        raise ValueError(
            f"data.prompt_template: {spec!r} is neither a template name ({', '.join(TEMPLATES)}) nor a custom "
            f"template string containing '{{instruction}}'"
        )
    if "{input}" in spec:
        return PromptTemplate(name="custom", input_format=spec, input_always=True)
    head, _, tail = spec.partition("{instruction}")
    return PromptTemplate(name="custom", user_format=head + "{content}" + tail)
