"""A request body's prompt as token ids, for a router that scores replicas by the KV blocks they
hold (router/kv_view.py): the body read by the same request models, and the prompt tokenized by
the same functions (prompts.py: the chat template, tools included) as jobs.py does for generation,
so the router's block digests are the ones the frontend's cache publishes.

Joined to the router by its program (programs/router.py), which loads the tokenizer; the router
package itself imports nothing of the frontend's.
"""

from __future__ import annotations

import json
from typing import Any

from pydantic import ValidationError
from transformers import PreTrainedTokenizerBase

from inferencemesh.frontend.engine.errors import ConstraintError
from inferencemesh.frontend.openai.chat.protocol import ChatCompletionRequest
from inferencemesh.frontend.openai.completions.protocol import CompletionRequest
from inferencemesh.frontend.openai.errors import APIError
from inferencemesh.frontend.openai.prompts import chat_ids, text_ids
from inferencemesh.frontend.openai.tools import tool_calling_from_request


def prompt_ids(tokenizer: PreTrainedTokenizerBase, path: str, body: bytes) -> list[int] | None:
    """The token ids the frontend would compute for this request's (first) prompt; None for a
    request it would refuse, or one whose prompt is not tokenized here (the Responses API)."""
    try:
        data: Any = json.loads(body)
        if path == "/v1/chat/completions":
            chat = ChatCompletionRequest.model_validate(data)
            calling = tool_calling_from_request(**chat.tool_fields())
            return chat_ids(tokenizer, chat.template_messages(), tools=calling.template_tools() if calling else None)
        if path == "/v1/completions":
            completion = CompletionRequest.model_validate(data)
            prompt = completion.prompts()[0]
            if isinstance(prompt, str):
                return text_ids(tokenizer, prompt, add_special_tokens=completion.add_special_tokens is not False)
            ids = list(prompt)
            # ids the frontend refuses (400) are not scored: an int of any size would reach the hash
            return ids if all(0 <= i < len(tokenizer) for i in ids) else None
    except (ValueError, RecursionError, ValidationError, APIError, ConstraintError, IndexError):
        return None
    return None
