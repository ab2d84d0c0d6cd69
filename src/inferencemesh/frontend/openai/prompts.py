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

A chat template is code from the checkpoint a user points `serve` at (transformers renders it in
jinja's sandbox: nothing escapes, but nothing bounds its work either). A render gets
RENDER_BUDGET_S: a template still looping then (nested loops over ranges) is stopped, by an
exception raised in its thread, and the request answered 500 saying so; a rendering longer than
MAX_RENDERED_CHARS is refused before it is tokenised. A worker thread is never held longer.
"""

from __future__ import annotations

import ctypes
import heapq
import itertools
import json
import logging
import re
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from transformers import PreTrainedTokenizerBase

from inferencemesh.frontend.openai.errors import APIError

log = logging.getLogger("inferencemesh.frontend")

RENDER_BUDGET_S = 2.0  # a chat template renders a conversation in milliseconds
MAX_RENDERED_CHARS = 16 * 1024 * 1024  # far beyond any context: a rendering this long is a template gone wrong


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
        with render_budget(RENDER_BUDGET_S):
            text = _render(tokenizer, messages, tools, add_generation_prompt, continue_final_message)
            template = _render(tokenizer, marked, tools, add_generation_prompt, continue_final_message) \
                if marks else text
    except RenderOverrun:
        raise APIError(500, f"The model's chat template did not finish rendering within {RENDER_BUDGET_S:g} s "
                            "(it loops without bound): fix the chat template.", type="server_error",
                       code="chat_template_error") from None
    except Exception as exc:  # templates raise on conversations they reject (e.g. role order)
        raise APIError(400, f"The chat template rejected the messages: {exc}", param="messages") from exc
    if max(len(text), len(template)) > MAX_RENDERED_CHARS:
        raise APIError(500, f"The model's chat template rendered more than {MAX_RENDERED_CHARS} characters: fix the "
                            "chat template.", type="server_error", code="chat_template_error")
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


class RenderOverrun(BaseException):  # noqa: N818 - raised into a thread, never by it
    """Raised inside a thread whose render ran past its budget. A BaseException: the template's
    and transformers' `except Exception` clauses let it through to render_budget's caller."""


class _Watchdog:
    """One daemon thread that stops renders past their deadline: it raises RenderOverrun in the
    rendering thread (CPython's PyThreadState_SetAsyncExc, delivered at the thread's next Python
    instruction: a template's loops are Python code). Each watch is stopped at most once."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._due: list[tuple[float, int, int]] = []  # (deadline, watch id, thread id), a heap
        self._active: set[int] = set()
        self._ids = itertools.count()
        self._thread: threading.Thread | None = None

    def start(self, seconds: float) -> int:
        with self._lock:
            watch = next(self._ids)
            self._active.add(watch)
            heapq.heappush(self._due, (time.monotonic() + seconds, watch, threading.get_ident()))
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="render-watchdog", daemon=True)
                self._thread.start()
            self._wake.notify()
            return watch

    def stop(self, watch: int) -> None:
        """The render is over: nothing is raised in its thread any more (a pending raise is withdrawn)."""
        with self._lock:
            if watch in self._active:
                self._active.discard(watch)
            else:  # stopped already: withdraw the exception should it not have arrived yet
                ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(threading.get_ident()), None)

    def _run(self) -> None:
        with self._lock:
            while True:
                now = time.monotonic()
                while self._due and (self._due[0][0] <= now or self._due[0][1] not in self._active):
                    _, watch, thread = heapq.heappop(self._due)
                    if watch in self._active:
                        self._active.discard(watch)
                        ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(thread),
                                                                   ctypes.py_object(RenderOverrun))
                self._wake.wait(self._due[0][0] - now if self._due else None)


_WATCHDOG = _Watchdog()


@contextmanager
def render_budget(seconds: float) -> Iterator[None]:
    """Run the block in this thread for at most `seconds`: RenderOverrun when it runs longer."""
    watch = _WATCHDOG.start(seconds)
    try:
        yield
    finally:
        _WATCHDOG.stop(watch)
