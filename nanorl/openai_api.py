"""
The OpenAI chat API as this server speaks it: the request bodies (pydantic), the error object, and turning a
validated request into prompt ids and engine settings, leaving out the oldest turns when the page's conversation
no longer fits the context. No HTTP here: scripts/chat_web.py routes requests to these functions.
"""

import json
from dataclasses import dataclass
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from nanorl.function_calls import ToolPlan, forced_prefix, tool_format

MAX_MESSAGES = 500  # per conversation
MAX_MESSAGE_CHARS = 8000  # per message
MAX_N = 8  # samples per request
MAX_STOPS = 4  # stop strings per request, as OpenAI
MAX_TOP_LOGPROBS = 20  # as OpenAI
MAX_TOOLS = 128  # as OpenAI
MAX_PROMPT_CHARS = MAX_MESSAGES * MAX_MESSAGE_CHARS  # /v1/completions and /tokenize: as much as a conversation
DEFAULT_COMPLETION_TOKENS = 16  # /v1/completions without max_tokens, as OpenAI and vLLM


@dataclass
class ServeConfig:
    """What the server allows and how it names itself."""

    max_tokens: int = 512  # the most a request may ask for (and its default)
    model: str | None = "nanorl"  # the name /v1/models reports; a request that names another model gets a 404
    # (None: any name is this model, as for the agents' endpoint, nanorl/agents.py)
    base: bool = False  # a base model continues the last message's text instead of a chat
    body_timeout: float = 30.0  # seconds a client has to send a request's body, once its headers are in
    max_body_bytes: int = 64 << 20  # 500 messages of 8000 characters, even with every character \u-escaped, fit
    token_bytes: int | None = None  # the longest token in bytes (create_app measures it): see render_prompt
    api_key: str | None = None  # if set, the API and the page's stream need "Authorization: Bearer <api_key>"


class BadRequest(Exception):
    """A request the server refuses: answered with an OpenAI error object and this status."""

    def __init__(self, message, param=None, code=None, status=400):
        super().__init__(message)
        code = code or ("invalid_value" if param else "invalid_request")  # every error object has a code
        self.message, self.param, self.code, self.status = message, param, code, status


def error_body(message, kind="invalid_request_error", param=None, code=None):
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


# --- request bodies ---------------------------------------------------------------------------------------------------
# pydantic checks every field's type and range; strict: "0.5" is not a number and true is not 1; extra="forbid":
# a field this server does not implement is a 400 naming it, never silently ignored.


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


def _check_stop(cls, v):
    stops = [v] if isinstance(v, str) else v or []
    if len(stops) > MAX_STOPS or not all(stops):
        raise ValueError(f"stop is a non-empty string or a list of up to {MAX_STOPS} of them")
    return v


def _check_penalty(cls, v):
    if v:
        raise ValueError("penalties are not implemented: only 0 (no penalty) is accepted")
    return v


def _check_top_k(cls, v):
    if v == 0:
        raise ValueError("top_k is a number of tokens >= 1, or -1 for no top-k")
    return v


class Part(_Body):
    type: Literal["text", "python", "python_output"] = "text"  # python parts: the page's own assistant turns
    text: str


TEXT_PARTS = ("text", "python", "python_output")


class FunctionCall(_Body):
    name: str = Field(min_length=1, max_length=64)
    arguments: str  # JSON text, as OpenAI sends it


class ToolCall(_Body):
    """A call an assistant message made (OpenAI's tool_calls[i]), as a client sends it back in the history."""

    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class Message(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[Part] | None = None  # None: only an assistant message that makes tool calls
    name: str | None = Field(None, min_length=1, max_length=64)  # accepted as OpenAI does; the chat format has
    # no speaker names, so it does not change the prompt
    tool_calls: list[ToolCall] | None = None  # assistant: the calls it made (function calling)
    tool_call_id: str | None = None  # tool: the call this message answers

    @field_validator("content", mode="before")
    @classmethod
    def _text_only(cls, v):
        for j, part in enumerate(v if isinstance(v, list) else []):
            kind = part.get("type", "text") if isinstance(part, dict) else "text"
            if kind not in TEXT_PARTS:
                raise ValueError(
                    f"part {j} has type {kind!r}: this model reads text only "
                    f"(a text part is {{'type': 'text', 'text': ...}})"
                )
        return v

    @model_validator(mode="after")
    def _check(self):
        if self.role == "tool" and not self.tool_call_id:
            raise ValueError("a tool message needs the tool_call_id of the call it answers")
        if self.tool_call_id is not None and self.role != "tool":
            raise ValueError("tool_call_id belongs to a tool message (role 'tool')")
        if self.tool_calls is not None and self.role != "assistant":
            raise ValueError("only an assistant message has tool_calls")
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ValueError("content is required (only an assistant message with tool_calls may leave it out)")
        parts = [Part(text=self.content)] if isinstance(self.content, str) else self.content or []
        if self.role != "assistant" and any(p.type != "text" for p in parts):
            raise ValueError(f"{self.role} content parts must have type 'text'")
        size = sum(len(p.text) for p in parts)
        if size > MAX_MESSAGE_CHARS:
            raise ValueError(f"message is too long: {size} characters > {MAX_MESSAGE_CHARS}")
        return self


class FunctionDef(_Body):
    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    parameters: dict | None = None  # a JSON schema, shown to the model as the template writes it
    strict: bool | None = None


class Tool(_Body):
    type: Literal["function"]
    function: FunctionDef


class FunctionName(_Body):
    name: str


class NamedToolChoice(_Body):
    type: Literal["function"]
    function: FunctionName


class PageRequest(_Body):
    """POST /ui/chat, the page's stream. None means the default."""

    messages: list[Message] = Field(min_length=1, max_length=MAX_MESSAGES)
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2, allow_inf_nan=False)  # 0 = greedy
    top_k: int | None = Field(None, ge=-1)  # -1: no top-k (as vLLM)
    top_p: float | None = Field(None, gt=0, le=1, allow_inf_nan=False)
    seed: int | None = Field(None, ge=-(2**62), le=2**62)

    _top_k = field_validator("top_k")(_check_top_k)


class StreamOptions(_Body):
    include_usage: bool = False


class ChatRequest(PageRequest):
    """POST /v1/chat/completions: the OpenAI fields this server implements, plus top_k."""

    model: str | None = None  # None: the served model
    max_completion_tokens: int | None = Field(None, ge=1)  # OpenAI's current name for max_tokens
    n: int | None = Field(None, ge=1, le=MAX_N)
    stop: str | list[str] | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    presence_penalty: float | None = None  # only 0 (no penalty): clients that always send the default work
    frequency_penalty: float | None = None
    user: str | None = None  # an end-user id for OpenAI's abuse monitoring; it never changes what is generated
    tools: list[Tool] | None = Field(None, max_length=MAX_TOOLS)  # function calling (nanorl/function_calls.py)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None

    _stop = field_validator("stop")(_check_stop)
    _penalty = field_validator("presence_penalty", "frequency_penalty")(_check_penalty)


class CompletionRequest(_Body):
    """POST /v1/completions: text in, its continuation out (the natural endpoint for a base model). One prompt per
    request: a string or token ids (a list of one of them too, as clients batch)."""

    model: str | None = None
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = Field(None, ge=1)  # None: DEFAULT_COMPLETION_TOKENS
    temperature: float | None = Field(None, ge=0, le=2, allow_inf_nan=False)
    top_k: int | None = Field(None, ge=-1)
    top_p: float | None = Field(None, gt=0, le=1, allow_inf_nan=False)
    seed: int | None = Field(None, ge=-(2**62), le=2**62)
    n: int | None = Field(None, ge=1, le=MAX_N)
    stop: str | list[str] | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)  # the legacy API's: alternatives per token
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    user: str | None = None

    _stop = field_validator("stop")(_check_stop)
    _penalty = field_validator("presence_penalty", "frequency_penalty")(_check_penalty)
    _top_k = field_validator("top_k")(_check_top_k)


class TokenizeRequest(_Body):
    """POST /tokenize: a prompt as /v1/completions reads it, or messages as /v1/chat/completions renders them."""

    model: str | None = None
    prompt: str | None = Field(None, max_length=MAX_PROMPT_CHARS)
    messages: list[Message] | None = Field(None, min_length=1, max_length=MAX_MESSAGES)
    add_special_tokens: bool = True  # prompt: start with <|bos|>, as /v1/completions does


class DetokenizeRequest(_Body):
    model: str | None = None
    tokens: list[int]


def validation_error(e):
    """pydantic's first error -> a BadRequest naming the field."""
    err = e.errors()[0]
    # pydantic also names union members and validators in loc (content.str, content.list[Part]): keep the fields
    loc = [str(x) for x in err["loc"] if not (isinstance(x, str) and ("[" in x or x in ("str", "body")))]
    path, msg = ".".join(loc), err["msg"].removeprefix("Value error, ")
    if err["type"] == "extra_forbidden":
        return BadRequest(
            f"unsupported parameter '{path}': this server does not implement it", loc[0], "unsupported_parameter"
        )
    return BadRequest(f"'{path}': {msg}" if path else msg, loc[0] if loc else None, "invalid_value")


def chat_messages(req):
    """Validated messages -> the tokenizer's conversation messages: 'developer' is OpenAI's newer 'system', and
    consecutive plain messages of one role become one, their contents joined by a blank line (as OpenAI and vLLM accept
    them; the chat format alternates user and assistant). Tool calls and tool results stay messages of their own."""
    out = []
    for i, m in enumerate(req.messages):
        msg = conversation_message(m, i)
        if out and out[-1]["role"] == msg["role"] and out[-1].keys() == msg.keys() == {"role", "content"}:
            prev, content = out[-1]["content"], msg["content"]
            if isinstance(prev, str) and isinstance(content, str):
                out[-1]["content"] = prev + "\n\n" + content
            else:
                as_parts = lambda c: [{"type": "text", "text": c}] if isinstance(c, str) else c  # noqa: E731
                out[-1]["content"] = as_parts(prev) + [{"type": "text", "text": "\n\n"}] + as_parts(content)
        else:
            out.append(msg)
    return out


def conversation_message(m, i=0):
    """One validated message -> a conversation message; tool calls get their arguments as objects, which is what chat
    templates render (as transformers and vLLM hand them over)."""
    role, content = "system" if m.role == "developer" else m.role, m.content
    if isinstance(content, list):  # assistant turns keep their tool parts; other roles' parts join into text
        plain = role == "assistant" and not m.tool_calls
        content = [p.model_dump() for p in content] if plain else "".join(p.text for p in content)
    msg = {"role": role, "content": content}
    if m.tool_calls:
        msg["tool_calls"] = []
        for j, call in enumerate(m.tool_calls):
            try:
                args = json.loads(call.function.arguments)
            except ValueError:
                args = None
            if not isinstance(args, dict):
                raise BadRequest(
                    f"'messages.{i}.tool_calls.{j}.function.arguments' must be a JSON object, got "
                    f"{call.function.arguments[:100]!r}",
                    "messages",
                )
            msg["tool_calls"].append(
                {"id": call.id, "type": "function", "function": {"name": call.function.name, "arguments": args}}
            )
    if m.tool_call_id is not None:
        msg["tool_call_id"] = m.tool_call_id
    return msg


def tool_plan(req, tokenizer):
    """How a chat request uses function calling: None when it has no tools and no tool messages; else the ToolPlan
    its reply is read with. BadRequest when the model's chat template cannot render tools (naming why) or the
    tool_choice names no given tool."""
    tools = getattr(req, "tools", None)
    choice = getattr(req, "tool_choice", None)
    if choice is not None and not tools:
        raise BadRequest("tool_choice needs tools: the functions the model may call", "tool_choice")
    if not tools and not any(m.role == "tool" or m.tool_calls for m in req.messages):
        return None
    try:
        fmt = tool_format(tokenizer)
    except ValueError as e:
        raise BadRequest(str(e), "tools" if tools else "messages", "tools_not_supported")
    if isinstance(choice, NamedToolChoice):
        if choice.function.name not in {t.function.name for t in tools}:
            raise BadRequest(
                f"tool_choice names {choice.function.name!r}, which is not one of the tools", "tool_choice"
            )
        choice = choice.function.name
    return ToolPlan(fmt, forced_prefix(fmt, choice), parse=bool(tools) and choice != "none")


def check_fits(ids, max_len):
    """A prompt must leave the context room for at least one generated token."""
    if max_len is not None and len(ids) >= max_len:
        raise BadRequest(
            f"the conversation is {len(ids)} tokens, over the context of {max_len} "
            f"(it needs room for at least one generated token)",
            "messages",
            "context_length_exceeded",
        )


def tool_prompt(tokenizer, messages, tools, plan, max_len):
    """A function-calling chat's prompt ids, rendered by the model's template with the tools (none when the reply may
    not call them), the forced start of the reply last."""
    if messages[-1]["role"] not in ("user", "tool"):
        raise BadRequest(
            f"the last message must be from the user or a tool (the model writes the next assistant turn), "
            f"got {messages[-1]['role']!r}",
            "messages",
        )
    shown = [t.model_dump(exclude_none=True) for t in tools or []] if plan.parse else None
    try:
        ids = tokenizer.render_messages(messages, shown, reply_prefix=plan.prefix)
    except ValueError as e:
        raise BadRequest(str(e), "messages")
    check_fits(ids, max_len)
    return ids


# --- prompt fitting ---------------------------------------------------------------------------------------------------


def _text(content):
    return content if isinstance(content, str) else "".join(p["text"] for p in content)


def _least_pairs(messages, max_len, room, token_bytes):
    """How many of the oldest user/assistant pairs must go whatever the tokenizer says: at token_bytes bytes a token,
    they would not fit. room=None (nothing may go): a conversation that cannot fit is refused here, untokenised."""
    sizes = [len(_text(m["content"]).encode()) for m in messages]
    start, total, least = (1 if messages[0]["role"] == "system" else 0), sum(sizes), 0
    while total / token_bytes + (room or 1) > max_len:
        if room is None:
            raise BadRequest(
                f"the conversation is at least {-(-total // token_bytes)} tokens, over the context of {max_len}",
                "messages",
                "context_length_exceeded",
            )
        if start + 2 * least + 1 >= len(messages) - 1:  # only the last user message is left
            break
        total -= sizes[start + 2 * least] + sizes[start + 2 * least + 1]
        least += 1
    return least


def _render_chat(tokenizer, messages, max_len, room, least):
    """A chat's prompt ids with the fewest oldest pairs (>= least) left out so that room tokens fit beside it."""
    if messages[-1]["role"] != "user":  # the renderer would silently drop a final assistant message
        raise BadRequest(
            f"the last message must be from the user (the model writes the next assistant turn), "
            f"got {messages[-1]['role']!r}",
            "messages",
        )
    head = messages[:1] if messages[0]["role"] == "system" else []

    def render(drop):
        try:
            return tokenizer.render_for_completion({"messages": head + messages[len(head) + drop :]})
        except ValueError as e:  # roles out of order, a system message alone, ...
            raise BadRequest(str(e), "messages")

    ids, dropped = render(2 * least), 2 * least
    if room is not None and len(ids) + room > max_len:
        lo, hi = least + 1, (len(messages) - len(head) - 1) // 2  # pairs that can go; the last user message stays
        while lo < hi:  # the prompt only shrinks as more pairs go: binary search, a few renders however long
            mid = (lo + hi) // 2
            if len(render(2 * mid)) + room <= max_len:
                hi = mid
            else:
                lo = mid + 1
        if hi >= 1:
            ids, dropped = render(2 * hi), 2 * hi
    return ids, dropped


def reply_reserve(max_tokens, max_len):
    """The room a conversation keeps for the reply when the oldest turns are left out to fit (the page, chat_cli): a
    quarter of the context, or max_tokens if less, so that earlier turns stay in the prompt; the reply itself may
    still run to max_tokens while the context has room."""
    return min(max_tokens, max(1, max_len // 4))


def render_prompt(tokenizer, messages, max_len, base=False, room=None, token_bytes=None):
    """Messages -> (prompt ids, how many of the oldest messages were left out). room=None: nothing is left out;
    else the fewest oldest user/assistant pairs are (a leading system message stays) so that the prompt leaves
    room tokens to generate, or as many as there are with only the last message kept. token_bytes, the longest
    token's bytes, bounds the tokens from below without tokenising: a huge conversation is refused (or cut) at once.
    max_len=None: no context to fit (tokenize)."""
    if base:  # a base model never saw chat tokens: it continues the last message's text
        ids, dropped = tokenizer.encode(_text(messages[-1]["content"]), prepend="<|bos|>"), 0
    else:
        least = _least_pairs(messages, max_len, room, token_bytes) if token_bytes and max_len else 0
        ids, dropped = _render_chat(tokenizer, messages, max_len, room, least)
    check_fits(ids, max_len)
    return ids, dropped


# --- a request, start to finish ---------------------------------------------------------------------------------------


def lone_surrogate(body):
    """Where in a parsed JSON body a string holds a lone surrogate (JSON's "\\ud800" escape parses to one, and no
    UTF-8 encoder takes it): (dotted path, character index), or None."""
    stack = [((), body)]
    while stack:
        path, x = stack.pop()
        if isinstance(x, dict):
            stack += [(path + (k,), k) for k in x] + [(path + (k,), v) for k, v in x.items()]
        elif isinstance(x, list):
            stack += [(path + (i,), v) for i, v in enumerate(x)]
        elif isinstance(x, str):
            try:
                x.encode("utf-8")
            except UnicodeEncodeError as e:  # the path may hold a surrogate too (in a key): show it escaped
                return ".".join(map(str, path)).encode("utf-8", "backslashreplace").decode(), e.start
    return None


def parse_body(raw, schema):
    """Raw body bytes -> a validated `schema` instance. Raises BadRequest."""
    try:
        body = json.loads(raw)
    except RecursionError:
        raise BadRequest("malformed JSON: nested too deeply", code="invalid_json")
    except ValueError as e:  # bad syntax, bad UTF-8, an integer of more than 4300 digits
        raise BadRequest(f"malformed JSON: {e}", code="invalid_json")
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
    bad = lone_surrogate(body)
    if bad is not None:
        raise BadRequest(
            f"'{bad[0]}': character {bad[1]} is a lone surrogate (a \\u escape of half a UTF-16 pair), not text",
            bad[0].split(".")[0] or None,
            "invalid_unicode",
        )
    try:
        return schema.model_validate(body)
    except ValidationError as e:
        raise validation_error(e)


def check_model(name, config):
    if name is not None and config.model is not None and name != config.model:
        raise BadRequest(
            f"the model '{name}' does not exist: this server serves '{config.model}'", "model", "model_not_found", 404
        )


def requested_max_tokens(req, config):
    """The request's max_tokens (or max_completion_tokens), checked against the server's limit; None: the limit."""
    max_tokens, param = req.max_tokens, "max_tokens"
    if getattr(req, "max_completion_tokens", None) is not None:
        if max_tokens is not None and max_tokens != req.max_completion_tokens:
            raise BadRequest(
                f"max_tokens ({max_tokens}) and max_completion_tokens ({req.max_completion_tokens}) "
                f"disagree: send one of them",
                "max_completion_tokens",
            )
        max_tokens, param = req.max_completion_tokens, "max_completion_tokens"
    if max_tokens is not None and max_tokens > config.max_tokens:
        raise BadRequest(
            f"'{param}' must be <= {config.max_tokens} (this server's --max-tokens), got {max_tokens}", param
        )
    return config.max_tokens if max_tokens is None else max_tokens


def stop_strings(req):
    return [req.stop] if isinstance(req.stop, str) else req.stop or []


def check_ids(ids, tokenizer, param):
    bad = next((i for i, t in enumerate(ids) if not 0 <= t < tokenizer.vocab_size), None)
    if bad is not None:
        raise BadRequest(
            f"'{param}': token {ids[bad]} at {bad} is not in the vocabulary (0..{tokenizer.vocab_size - 1})", param
        )


def prompt_ids(prompt, tokenizer, config, max_len):
    """A completion's prompt (text, or token ids kept as they are) -> ids, refused if it leaves no room to generate.
    Text too long for the context is refused by its size alone (config.token_bytes), before tokenising."""
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        if len(prompt) != 1:
            raise BadRequest(f"send one prompt per request (got {len(prompt)})", "prompt")
        prompt = prompt[0]
    if isinstance(prompt, str):
        if len(prompt) > MAX_PROMPT_CHARS:
            raise BadRequest(f"the prompt is {len(prompt)} characters > {MAX_PROMPT_CHARS}", "prompt")
        size = len(prompt.encode())
        if config.token_bytes and size / config.token_bytes >= max_len:
            raise BadRequest(
                f"the prompt is at least {-(-size // config.token_bytes)} tokens, over the context of {max_len}",
                "prompt",
                "context_length_exceeded",
            )
        ids = tokenizer.encode(prompt, prepend="<|bos|>")  # a document starts with it
    else:
        ids = list(prompt)
        check_ids(ids, tokenizer, "prompt")
    if len(ids) >= max_len:
        raise BadRequest(
            f"the prompt is {len(ids)} tokens, over the context of {max_len} (it needs room for at "
            f"least one generated token)",
            "prompt",
            "context_length_exceeded",
        )
    if not ids:
        raise BadRequest("the prompt has no tokens", "prompt")
    return ids


def prepare_completion(raw, tokenizer, config, max_len):
    """Raw /v1/completions body -> (validated request, prompt ids, engine settings). The text continues as a
    document does: it ends at the next <|bos|> (or at max_tokens)."""
    req = parse_body(raw, CompletionRequest)
    check_model(req.model, config)
    if req.stream_options is not None and not req.stream:
        raise BadRequest("stream_options is only allowed with stream: true", "stream_options")
    if req.max_tokens is not None and req.max_tokens > config.max_tokens:
        raise BadRequest(
            f"'max_tokens' must be <= {config.max_tokens} (this server's --max-tokens), got {req.max_tokens}",
            "max_tokens",
        )
    max_tokens = req.max_tokens or min(DEFAULT_COMPLETION_TOKENS, config.max_tokens)
    ids = prompt_ids(req.prompt, tokenizer, config, max_len)
    settings = dict(
        max_tokens=min(max_tokens, max_len - len(ids)),
        temperature=1.0 if req.temperature is None else req.temperature,
        top_k=None if req.top_k == -1 else req.top_k,
        top_p=req.top_p,
        num_samples=req.n or 1,
        seed=req.seed,
        stop_tokens=[tokenizer.get_bos_token_id()],
    )
    return req, ids, settings


def tokenize(raw, tokenizer, config, max_len):
    """Raw /tokenize body -> the prompt ids the completions or chat endpoint would generate from (not refused for
    their length: counting tokens is what it is for)."""
    req = parse_body(raw, TokenizeRequest)
    check_model(req.model, config)
    if (req.prompt is None) == (req.messages is None):
        raise BadRequest("send either 'prompt' or 'messages'", "prompt")
    if req.prompt is not None:
        return tokenizer.encode(req.prompt, prepend="<|bos|>" if req.add_special_tokens else None)
    return render_prompt(tokenizer, chat_messages(req), None, config.base)[0]


def detokenize(raw, tokenizer, config):
    req = parse_body(raw, DetokenizeRequest)
    check_model(req.model, config)
    check_ids(req.tokens, tokenizer, "tokens")
    return tokenizer.decode(req.tokens)


def prepare(raw, tokenizer, config, max_len, schema=ChatRequest, fit=False):
    """Raw body bytes -> (validated request, prompt ids, engine settings, messages left out). Raises BadRequest.
    For a big conversation this is seconds of CPU (JSON, validation, tokenising): the handlers run it in a worker
    thread. fit=True (the page) leaves out the oldest turns that do not fit beside reply_reserve's room."""
    req = parse_body(raw, schema)
    api = isinstance(req, ChatRequest)
    if api:
        check_model(req.model, config)
        if req.stream_options is not None and not req.stream:
            raise BadRequest("stream_options is only allowed with stream: true", "stream_options")
        if req.top_logprobs is not None and not req.logprobs:
            raise BadRequest("top_logprobs needs logprobs: true", "top_logprobs")
    max_tokens = requested_max_tokens(req, config)
    plan = tool_plan(req, tokenizer)
    if plan is not None:
        ids, dropped = tool_prompt(tokenizer, chat_messages(req), req.tools, plan, max_len), 0
    else:
        room = reply_reserve(max_tokens, max_len) if fit else None
        ids, dropped = render_prompt(tokenizer, chat_messages(req), max_len, config.base, room, config.token_bytes)
    settings = dict(
        max_tokens=min(max_tokens, max_len - len(ids)),  # ending at the context edge is finish_reason "length"
        temperature=req.temperature if req.temperature is not None else (1.0 if api else 0.6),
        top_k=None if req.top_k == -1 else req.top_k if req.top_k is not None or api else 50,
        top_p=req.top_p,
        num_samples=(req.n or 1) if api else 1,
        seed=req.seed,
        stop_tokens=[tokenizer.get_bos_token_id()] if config.base else None,  # None: the end of the assistant's turn
    )
    return req, ids, settings, dropped
