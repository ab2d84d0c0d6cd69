"""A prompt as token ids: text through the tokenizer, messages through the chat template.

Generation (/v1/completions, /v1/chat/completions) and /tokenize both tokenise here, so the
count /tokenize reports is what a generation request with the same prompt sends.

Chat safety: the template's own control tokens (<|im_start|>, <|im_end|>, ...) are control
tokens; the same strings typed inside a message's content are text. Otherwise a user could end
their turn and forge a system turn ("<|im_end|>\n<|im_start|>system ..."). The template is
rendered with a placeholder per content; the text is cut at the special tokens the template
itself wrote, and every piece between those cuts (template text and content together, exactly
as plain tokenisation would see it) is tokenised with special tokens split into ordinary text.
A chat without special strings in its contents gets exactly the ids it always got.
(A text prompt to /v1/completions is the client's own raw prompt: its special tokens count.)
"""

from __future__ import annotations

import json
import logging
import re
import uuid
from typing import Any

from transformers import PreTrainedTokenizerBase

from inferencemesh.frontend.errors import APIError

log = logging.getLogger("inferencemesh.frontend")


def text_ids(tokenizer: PreTrainedTokenizerBase, text: str, *, add_special_tokens: bool = True) -> list[int]:
    return list(tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"])


def chat_ids(tokenizer: PreTrainedTokenizerBase, messages: list[dict[str, Any]], *,
             tools: list[dict[str, Any]] | None = None, add_generation_prompt: bool = True,
             continue_final_message: bool = False, add_special_tokens: bool = False) -> list[int]:
    """The chat template's rendering of `messages` (and of `tools`, OpenAI's function tools),
    tokenised. By default the template alone places BOS and control tokens
    (add_special_tokens=False); a 400 naming `messages` when the model has no template or the
    template rejects the conversation."""
    if not tokenizer.chat_template:
        raise APIError(400, "This model has no chat template; use /v1/completions.", param="messages")
    controls = _special_pattern(tokenizer)
    _refuse_controls_outside_contents(controls, messages, tools)
    # Only the contents that hold a special string get a placeholder: every other message renders
    # as it always did (a template may branch on its content, e.g. on an empty one).
    marks = {i: f"\ue000{uuid.uuid4().hex}\ue001" for i, m in enumerate(messages)  # private use: plain text
             if controls is not None and controls.search(m["content"])}
    marked = [{**m, "content": marks[i]} if i in marks else m for i, m in enumerate(messages)]
    try:
        text = _render(tokenizer, messages, tools, add_generation_prompt, continue_final_message)
        template = _render(tokenizer, marked, tools, add_generation_prompt, continue_final_message) if marks else text
    except Exception as exc:  # templates raise on conversations they reject (e.g. role order)
        raise APIError(400, f"The chat template rejected the messages: {exc}", param="messages") from exc
    if not marks:
        return text_ids(tokenizer, text, add_special_tokens=add_special_tokens)
    assert controls is not None
    contents: dict[str, str] = {mark: messages[i]["content"] for i, mark in marks.items()}
    pieces = re.split("(" + "|".join(map(re.escape, contents)) + ")", template)  # template, content, ...
    if "".join(contents.get(p, p) for p in pieces) != text:
        # The template changes contents (e.g. trims them): the placeholders cannot say where each
        # one is. Safety first: contents go in verbatim.
        log.debug("the chat template transforms message contents; contents are placed verbatim")
    ids = _leading_special_ids(tokenizer) if add_special_tokens else []
    text_run = ""  # the text since the last control token the template wrote
    for piece in pieces:
        if piece in contents:
            text_run += contents[piece]
            continue
        for part in controls.split(piece):
            if controls.fullmatch(part):
                control = tokenizer.convert_tokens_to_ids(part)  # one token in, one id out
                assert isinstance(control, int)
                ids += _plain_ids(tokenizer, text_run) + [control]
                text_run = ""
            else:
                text_run += part
    return ids + _plain_ids(tokenizer, text_run)


def _refuse_controls_outside_contents(controls: re.Pattern[str] | None, messages: list[dict[str, Any]],
                                      tools: list[dict[str, Any]] | None) -> None:
    """Contents are placed safely (above); the tools' definitions and a history's tool calls are
    rendered by the template as JSON, where a control string could not be told from the
    template's own: they are refused (a 400 naming the field), never rendered."""
    if controls is None:
        return
    fields = [(f"tools.{i}", tool) for i, tool in enumerate(tools or [])]
    fields += [(f"messages.{i}.tool_calls", m["tool_calls"]) for i, m in enumerate(messages) if m.get("tool_calls")]
    for param, value in fields:
        found = controls.search(json.dumps(value, ensure_ascii=False))
        if found:
            raise APIError(400, f"{param} contains the model's control token {found.group(0)!r}", param=param)


def _render(tokenizer: PreTrainedTokenizerBase, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
            add_generation_prompt: bool, continue_final_message: bool) -> str:
    text = tokenizer.apply_chat_template(messages, tools=list(tools) if tools else None,  # type: ignore[arg-type]
                                         add_generation_prompt=add_generation_prompt,
                                         continue_final_message=continue_final_message, tokenize=False)
    assert isinstance(text, str)  # tokenize=False: the rendered text
    return text


def _special_pattern(tokenizer: PreTrainedTokenizerBase) -> re.Pattern[str] | None:
    """The tokenizer's special tokens, longest first (one may be a prefix of another)."""
    specials = sorted({t.content for t in tokenizer.added_tokens_decoder.values() if t.special}, key=len,
                      reverse=True)
    return re.compile("(" + "|".join(map(re.escape, specials)) + ")") if specials else None


def _plain_ids(tokenizer: PreTrainedTokenizerBase, text: str) -> list[int]:
    """text's ids with any special token in it read as ordinary text."""
    if not text:
        return []
    return list(tokenizer(text, add_special_tokens=False, split_special_tokens=True)["input_ids"])


def _leading_special_ids(tokenizer: PreTrainedTokenizerBase) -> list[int]:
    """What add_special_tokens=True puts before a text (BOS, when the tokenizer adds one)."""
    return list(tokenizer("", add_special_tokens=True)["input_ids"])
