"""A prompt as token ids: text through the tokenizer, messages through the chat template.

Generation (/v1/completions, /v1/chat/completions) and /tokenize both tokenise here, so the
count /tokenize reports is what a generation request with the same prompt sends.
"""

from __future__ import annotations

from transformers import PreTrainedTokenizerBase

from inferencemesh.frontend.errors import APIError


def text_ids(tokenizer: PreTrainedTokenizerBase, text: str, *, add_special_tokens: bool = True) -> list[int]:
    return list(tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"])


def chat_ids(tokenizer: PreTrainedTokenizerBase, messages: list[dict[str, str]], *,
             add_generation_prompt: bool = True, continue_final_message: bool = False,
             add_special_tokens: bool = False) -> list[int]:
    """The chat template's rendering of `messages`, tokenised. By default the template alone
    places BOS and control tokens (add_special_tokens=False); a 400 naming `messages` when the
    model has no template or the template rejects the conversation."""
    if not tokenizer.chat_template:
        raise APIError(400, "This model has no chat template; use /v1/completions.", param="messages")
    try:
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt,
                                             continue_final_message=continue_final_message, tokenize=False)
    except Exception as exc:  # templates raise on conversations they reject (e.g. role order)
        raise APIError(400, f"The chat template rejected the messages: {exc}", param="messages") from exc
    return text_ids(tokenizer, text, add_special_tokens=add_special_tokens)
