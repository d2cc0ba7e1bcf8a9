"""The request body of POST /v1/responses (OpenAI's Responses API), as pydantic models.

The shapes are OpenAI's: `input` is a string or a list of items (messages, and the function calls
and outputs of an earlier turn), tools are flat function definitions, `text.format` asks for a
structured output. What pydantic checks here (an item's type, a message's role, a content part's
type, the fields each kind of item needs) is a 400 naming the field; known fields tokenmill does
not implement (`background`, `include`, `top_logprobs`, `truncation` "auto", `conversation`,
`prompt`, `max_tool_calls`, a `service_tier` other than "auto" or "default") are a 400 too.
Unknown fields are ignored, as elsewhere. Types are strict, as the OpenAPI schema states them: 0
is no boolean and "5" no number.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag, field_validator, model_validator

from tokenmill.server.protocol import APIRequest

MAX_METADATA_PAIRS, MAX_METADATA_KEY, MAX_METADATA_VALUE = 16, 64, 512   # OpenAI's limits
# The Responses fields tokenmill does not implement, and the values of each that ask for nothing
UNUSED = {"background": (False,), "include": (None, []), "top_logprobs": (None, 0), "truncation": (None, "disabled"),
          "conversation": (None,), "prompt": (None,), "max_tool_calls": (None,),
          "service_tier": (None, "auto", "default")}


def text_or_list(item: type[BaseModel]):
    """A string, or a list of `item`s. A value is read as the one its JSON type says, so that an error
    in a list names its place in the list rather than saying the value is no string (the error
    handler drops the branch names, which read as types: "str", "list[...]")."""
    listed = f"list[{item.__name__}]"
    return Annotated[Annotated[str, Tag("str")] | Annotated[list[item], Tag(listed)],
                     Discriminator(lambda value: "str" if isinstance(value, str) else listed)]


class StrictModel(BaseModel):
    """Strict types, as the schema states them; unknown fields ignored."""

    model_config = ConfigDict(strict=True, extra="ignore")


class TextPart(StrictModel):
    """A text content part: `input_text` in what the user sends, `output_text` in an assistant's,
    `reasoning_text` in a reasoning item's."""

    type: Literal["input_text", "output_text", "reasoning_text"]
    text: str


Text = text_or_list(TextPart)


ITEM_FIELDS = {"message": ("role", "content"), "function_call": ("call_id", "name", "arguments"),
               "function_call_output": ("call_id", "output"), "reasoning": ()}


class InputItem(StrictModel):
    """One item of `input`: a message (its `type` may be left out), a function call the model made
    in an earlier turn (an output item sent back), the output of such a call, or an earlier turn's
    reasoning (sent back with the output; the conversation drops it)."""

    type: Literal["message", "function_call", "function_call_output", "reasoning"] = "message"
    role: Literal["user", "system", "developer", "assistant"] | None = None   # message
    content: Text | None = None                                              # message
    call_id: str | None = None                                               # function_call(_output)
    name: str | None = None                                                  # function_call
    arguments: str | None = None                                             # function_call: JSON text
    output: Text | None = None                                               # function_call_output

    @model_validator(mode="after")
    def _has_the_fields_of_its_type(self) -> InputItem:
        missing = [name for name in ITEM_FIELDS[self.type] if getattr(self, name) is None]
        if missing:
            raise ValueError(f"a {self.type} item needs {' and '.join(missing)}")
        return self


Input = text_or_list(InputItem)


class FunctionTool(StrictModel):
    """A function the model may call (the only kind of tool served: no built-in tools)."""

    type: Literal["function"]
    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict | None = None       # its arguments' JSON schema
    strict: bool | None = None           # (the arguments always follow the schema)

    def as_chat_tool(self) -> dict:
        """The chat completions form, {"type": "function", "function": {...}}, as chat templates take it."""
        function = {"name": self.name, **({"description": self.description} if self.description is not None else {}),
                    "parameters": self.parameters or {"type": "object", "properties": {}}}  # (OpenAI's order)
        return {"type": "function", "function": function}


class FunctionChoice(StrictModel):
    """tool_choice naming the function the model must call."""

    type: Literal["function"]
    name: str


class TextFormat(StrictModel):
    """text.format: plain text, any JSON object, or JSON that follows `schema`."""

    model_config = ConfigDict(populate_by_name=True)

    type: Literal["text", "json_object", "json_schema"] = "text"
    name: str | None = None
    json_schema: dict | None = Field(default=None, alias="schema")
    description: str | None = None
    strict: bool | None = None           # (the output always follows the schema)

    @model_validator(mode="after")
    def _schema_for_json_schema(self) -> TextFormat:
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("a json_schema format needs its schema, a JSON schema object")
        if self.type == "json_schema" and not self.name:
            raise ValueError("a json_schema format needs a name, as OpenAI's API does")
        return self

    def constraint(self) -> dict | None:
        """The structured output it asks for (StructuredOutputsParams fields), None for text."""
        if self.type == "json_object":
            return {"json_object": True}
        return {"json": self.json_schema} if self.type == "json_schema" else None

    def as_dict(self) -> dict:
        return self.model_dump(by_alias=True, exclude_none=True)


class TextConfig(StrictModel):
    format: TextFormat = Field(default_factory=TextFormat)


class ReasoningConfig(StrictModel):
    effort: Literal["low", "medium", "high"] | None = None   # to the chat template (gpt-oss's reads it)


class ResponsesRequest(APIRequest):
    """POST /v1/responses."""

    model_config = ConfigDict(strict=True)

    model: str | None = None
    input: Input
    instructions: str | None = None               # a system message before everything else
    previous_response_id: str | None = None       # that response's input and output come first
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    stream: bool = False
    store: bool = True                            # keep it for a later previous_response_id
    metadata: dict[str, str] | None = None
    text: TextConfig | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | FunctionChoice | None = None
    parallel_tool_calls: bool = True
    reasoning: ReasoningConfig | None = None
    user: str | None = None
    cache_salt: str | None = None                 # vLLM's: cached blocks shared only within one salt
    priority: int = 0                             # vLLM's, for --scheduling-policy priority (lower first)
    deadline: float | None = Field(default=None, gt=0, allow_inf_nan=False)  # seconds from arrival, for edf
    # known, not implemented: a value other than those in UNUSED is a 400 naming the field (each
    # would change the answer, or promise what it does not hold, if it were ignored)
    background: bool = False                      # (the server answers while the client waits)
    include: list[str] | None = None              # (output_text logprobs, encrypted reasoning, ...)
    top_logprobs: int | None = None
    truncation: Literal["auto", "disabled"] | None = None
    conversation: str | dict | None = None        # (a stored conversation's items come first)
    prompt: dict | None = None                    # (a stored prompt template)
    max_tool_calls: int | None = None
    service_tier: str | None = None               # ("auto" and "default" are what it does)

    @field_validator(*UNUSED)
    @classmethod
    def _not_implemented(cls, value, info):
        if value not in UNUSED[info.field_name]:
            raise ValueError(f"{value!r} is not supported by this server")
        return value

    @field_validator("metadata")
    @classmethod
    def _within_openai_limits(cls, value: dict[str, str] | None) -> dict[str, str] | None:
        if value is not None and (len(value) > MAX_METADATA_PAIRS or any(
                len(k) > MAX_METADATA_KEY or len(v) > MAX_METADATA_VALUE for k, v in value.items())):
            raise ValueError(f"at most {MAX_METADATA_PAIRS} pairs, keys of at most {MAX_METADATA_KEY} "
                             f"characters and values of at most {MAX_METADATA_VALUE}")
        return value

    @property
    def text_format(self) -> TextFormat:
        return self.text.format if self.text is not None else TextFormat()
