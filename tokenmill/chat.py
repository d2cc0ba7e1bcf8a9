"""Chat prompts: a conversation through the model's chat template, to text and token ids.

One function for the offline API (LLM.chat, `tokenmill chat`) and the server, so both read
OpenAI's content parts the same way and render the same text for the same conversation.
"""

from __future__ import annotations

import inspect
import json

from tokenmill.sampling_params import check_depth, is_unicode, too_deep


def content_text(content) -> str:
    """A message's content as plain text: a string, nothing, or OpenAI's list of content parts,
    whose text parts are joined with newlines (as vLLM joins them); other parts are refused."""
    if content is None or isinstance(content, str):
        return content or ""
    if not isinstance(content, list):
        raise ValueError(f"a message's content must be a string, null or a list of text parts, got {content!r}")
    parts = []
    for part in content:
        if not isinstance(part, dict) or part.get("type") != "text":
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise ValueError(f"unsupported content part type {kind!r} (only 'text')")
        if not isinstance(part.get("text"), str):
            raise ValueError(f"a text content part's 'text' must be a string, got {part.get('text')!r}")
        parts.append(part["text"])
    return "\n".join(parts)


def _with_argument_objects(tool_calls: list, where: str) -> list:
    """An assistant message's tool calls with their JSON-text arguments (OpenAI's form) as objects,
    the form chat templates (Qwen's, Llama's) write out; arguments that are no JSON stay text.
    ValueError naming the call (`where`: the message's place) for arguments nested past
    MAX_JSON_DEPTH, or past JSON's decoder (RecursionError)."""
    out = []
    for k, call in enumerate(tool_calls):
        function = call.get("function") if isinstance(call, dict) else None
        if isinstance(function, dict) and isinstance(function.get("arguments"), str):
            place = f"{where}.tool_calls.{k}.function.arguments"
            try:
                arguments = json.loads(function["arguments"])
            except ValueError:
                arguments = function["arguments"]
            except RecursionError:
                raise too_deep(place) from None
            check_depth(arguments, place)
            call = {**call, "function": {**function, "arguments": arguments}}
        out.append(call)
    return out


# Phi-4-mini's template (and Phi-4-multimodal's) reads the tools from a system message's own
# `tools`, a JSON text it shows between <|tool|> and <|/tool|>, not from the `tools` variable, and
# writes no calls: the model's own come back in the assistant's content, between these tokens
TOOLS_IN_SYSTEM_MARKERS = ("<|tool|>", "message['tools']")
TOOLS_SYSTEM_PROMPT = "You are a helpful assistant with some tools."   # the model card's, where none is given
CALL_START, CALL_END = "<|tool_call|>", "<|/tool_call|>"


def _takes_tools_in_system(tokenizer) -> bool:
    template = getattr(tokenizer, "chat_template", None)
    return isinstance(template, str) and all(marker in template for marker in TOOLS_IN_SYSTEM_MARKERS)


def _with_tools_in_system(messages: list[dict], tools: list[dict] | None) -> list[dict]:
    """The conversation as Phi-4-mini's template takes it: the tools' functions as JSON text in the
    first system message's `tools` (one with the model card's wording put first where there is
    none; a system message that has its own `tools` keeps them), and each assistant's calls after
    its content as the model writes them, <|tool_call|>[{"name", "arguments"}, ...]<|/tool_call|>."""
    out = [dict(m) for m in messages]
    if tools and not any(m["role"] == "system" and "tools" in m for m in out):
        if not out or out[0]["role"] != "system":
            out.insert(0, {"role": "system", "content": TOOLS_SYSTEM_PROMPT})
        functions = [t.get("function", t) if isinstance(t, dict) else t for t in tools]
        out[0]["tools"] = json.dumps(functions, ensure_ascii=False)
    for m in out:
        functions = [c.get("function") for c in m.get("tool_calls") or [] if isinstance(c, dict)]
        calls = [{"name": f.get("name"), "arguments": f.get("arguments", {})} for f in functions if isinstance(f, dict)]
        if m["role"] == "assistant" and calls:
            m["content"] += CALL_START + json.dumps(calls, ensure_ascii=False) + CALL_END
    return out


def _knows_developer(tokenizer) -> bool:
    """Whether the chat template has a developer role of its own (gpt-oss's does); where it has
    none, a developer message is the system message (as OpenAI's API and vLLM take it), not a
    turn of an unknown role after the template's default system prompt."""
    template = getattr(tokenizer, "chat_template", None)
    return isinstance(template, str) and "developer" in template


def _template_options(tokenizer) -> set[str]:
    """apply_chat_template's own parameters (chat_template, tokenizer_kwargs, return_dict, ...):
    what template variables from a request may not set. A template is code the server runs: one
    from a request could keep a thread busy for as long as it likes."""
    parameters = inspect.signature(tokenizer.apply_chat_template).parameters.values()
    return {p.name for p in parameters if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)} | {"messages"}


def render_chat(tokenizer, conversation: list[dict], add_generation_prompt: bool = True,
                tools: list[dict] | None = None, template_kwargs: dict | None = None,
                continue_final_message: bool = False) -> dict:
    """{"prompt": text, "prompt_token_ids": ids} for a list of {"role", "content", ...} messages
    (and the tools the template shows the model; template_kwargs: the template's own variables,
    such as Qwen3's enable_thinking; continue_final_message: the last message left open, for the
    model to go on writing it); ValueError for a message without a role, a content part that is
    not text, or a conversation the template rejects."""
    if not isinstance(conversation, list):
        raise ValueError(f"a conversation is a list of messages, got {type(conversation).__name__} {conversation!r}")
    messages, developer = [], _knows_developer(tokenizer)
    for i, m in enumerate(conversation):
        if not isinstance(m, dict) or "role" not in m:
            raise ValueError(f"a chat message needs a 'role' (and a 'content'), got {m!r}")
        messages.append({**m, "content": content_text(m.get("content"))})
        if m["role"] == "developer" and not developer:  # OpenAI's newer name for the system message
            messages[-1]["role"] = "system"
        if isinstance(m.get("tool_calls"), list):
            messages[-1]["tool_calls"] = _with_argument_objects(m["tool_calls"], f"messages.{i}")
    if _takes_tools_in_system(tokenizer):
        messages = _with_tools_in_system(messages, tools)
    reserved = _template_options(tokenizer) & set(template_kwargs or {})
    if reserved:
        raise ValueError(f"chat_template_kwargs may not set {', '.join(sorted(reserved))}: only the template's "
                         "own variables")
    try:
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=False,
                                             tools=tools, **(template_kwargs or {}),
                                             **({"continue_final_message": True} if continue_final_message else {}))
    except Exception as exc:  # jinja raises for conversations the template rejects
        raise ValueError(f"cannot apply the chat template: {exc}") from None
    if not is_unicode(text):  # bytes that were no UTF-8 (a shell's stdin)
        raise ValueError("the conversation is not valid UTF-8 text")
    return {"prompt": text, "prompt_token_ids": tokenizer.encode(text, add_special_tokens=False)}
