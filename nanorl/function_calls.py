"""
Function calling, OpenAI's `tools`: which chat templates render tools, what a request's tool_choice forces at the
start of a reply, and reading the calls a model wrote back out of its text, the way each family's model card has
the model write them:

  hermes       Qwen2.5, Qwen3 (and Hermes-format models): any text, then one or more
               <tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>
  llama3_json  Llama 3.1 / 3.2 / 3.3: the whole reply is {"name": ..., "parameters": {...}}, optionally after
               <|python_tag|>; several calls are joined by ";"

A reply whose calls do not parse is plain text (finish_reason "stop"), as vLLM reads it. The request side (the
`tools`, `tool_choice` and tool-message fields) is validated in nanorl/openai_api.py and rendered by the model's own
chat template (HFTokenizer.render_messages); chat_web and the agents' endpoint (nanorl/agents.py) build their replies
with ReplyStream and reply_message here.
"""

import json
import re
import uuid
from dataclasses import dataclass

HERMES_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)
PYTHON_TAG = "<|python_tag|>"


def tool_format(tokenizer):
    """'hermes' or 'llama3_json': how this tokenizer's chat template writes tool calls. ValueError saying why when it
    renders none (nanorl's own chat format, a template that never mentions tools, one in a format not read here)."""
    template = getattr(tokenizer, "chat_template", None)
    if not template:
        raise ValueError(
            "this model's chat format has no function calling (nanorl's own format: its one tool is the calculator "
            "the engine runs inside a reply); tools need an open model whose chat template renders them, e.g. "
            "Qwen2.5, Qwen3 or Llama 3.x loaded with --hf-model"
        )
    if "tools" not in template:
        raise ValueError("this model's chat template does not render tools: the model was never shown how to call one")
    if "<tool_call>" in template:
        return "hermes"
    if "<|start_header_id|>" in template:
        return "llama3_json"
    raise ValueError(
        "this model's chat template renders tools in a format this server cannot read back "
        "(it reads Qwen's <tool_call> blocks and Llama 3's JSON calls)"
    )


@dataclass
class ToolPlan:
    """How one request's reply is read: the template's call format, the text forced at the start of the reply (a
    tool_choice of "required" or of one named function; the model writes the rest), and whether calls are read back
    at all (tool_choice "none": the reply is text)."""

    format: str
    prefix: str = ""
    parse: bool = True


def forced_prefix(fmt, choice):
    """The start of a reply that tool_choice forces: "required" opens a call, {"function": {"name": f}} opens a call
    of f; "auto" and "none" force nothing. The engine has no constrained decoding, so the model writes the rest of the
    call (arguments included) itself, and a call that then does not parse comes back as text."""
    if choice in (None, "auto", "none"):
        return ""
    opening = "" if choice == "required" else '{"name": ' + json.dumps(choice)
    if fmt == "hermes":
        return "<tool_call>\n" + (opening and opening + ', "arguments": ')
    return opening + ', "parameters": ' if opening else '{"name": "'


# --- reading calls back -----------------------------------------------------------------------------------------------


def _call(obj, args_key):
    """A parsed JSON object -> {"name", "arguments" (a JSON string)}, or None if it is no call."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    args = obj.get(args_key, obj.get("arguments", {}))
    if isinstance(args, str):  # already JSON text
        try:
            json.loads(args)
        except ValueError:
            return None
        return {"name": obj["name"], "arguments": args}
    if not isinstance(args, dict):
        return None
    return {"name": obj["name"], "arguments": json.dumps(args, ensure_ascii=False)}


def parse_calls(text, fmt):
    """A reply's text -> (content or None, [{"name", "arguments"}]). No calls: (text, [])."""
    if fmt == "hermes":
        blocks = HERMES_CALL.findall(text)
        if not blocks:
            return text, []
        try:
            calls = [_call(json.loads(b), "arguments") for b in blocks]
        except ValueError:
            return text, []
        if None in calls:
            return text, []
        content = text[: text.find("<tool_call>")]
        return content or None, calls
    s = text.strip().removeprefix(PYTHON_TAG).strip()  # llama3_json: the whole reply is the call(s)
    decoder, calls, pos = json.JSONDecoder(), [], 0
    while pos < len(s):
        try:
            obj, end = decoder.raw_decode(s, pos)
        except ValueError:
            return text, []
        calls.append(_call(obj, "parameters"))
        pos = end
        while pos < len(s) and s[pos] in "; \n\t":
            pos += 1
    if not calls or None in calls:
        return text, []
    return None, calls


def openai_calls(calls):
    """Parsed calls -> OpenAI's tool_calls, each with a fresh id."""
    return [
        {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function", "function": dict(c)}
        for c in calls  # {"name", "arguments"}
    ]


def reply_message(text, plan=None):
    """A reply (the text the model wrote after any forced prefix) -> the assistant message: its calls read back (each
    with a fresh id) when the plan reads calls and there are any, else the text as content."""
    return _read((plan.prefix if plan is not None else "") + text, plan)


def _read(text, plan):
    if plan is None or not plan.parse:
        return {"role": "assistant", "content": text}
    content, calls = parse_calls(text, plan.format)
    if not calls:
        return {"role": "assistant", "content": text}
    return {"role": "assistant", "content": content, "tool_calls": openai_calls(calls)}


def chat_choice(index, message, finish_reason, logprobs=None):
    """An assistant message -> OpenAI's (non-streamed) choice; a message that calls tools finishes "tool_calls"."""
    finish_reason = "tool_calls" if message.get("tool_calls") else finish_reason
    return {"index": index, "message": message, "logprobs": logprobs, "finish_reason": finish_reason}


def final_deltas(index, message, finish_reason, logprobs=None, sent=0):
    """A reply's last streamed choice deltas: its content from character `sent` on (what was not streamed yet), then
    its tool calls (one delta, as a client accumulates them) with the finish_reason."""
    rest = (message["content"] or "")[sent:]
    out = [_delta(index, {"content": rest})] if rest else []
    last = {}
    if message.get("tool_calls"):
        last = {"tool_calls": [{"index": k, **c} for k, c in enumerate(message["tool_calls"])]}
        finish_reason = "tool_calls"
    return out + [{**_delta(index, last), "logprobs": logprobs, "finish_reason": finish_reason}]


def _delta(index, delta):
    return {"index": index, "delta": delta, "logprobs": None, "finish_reason": None}


class ReplyStream:
    """One streamed choice of a chat reply: text deltas in, OpenAI choice deltas out. Without tools every delta goes
    out at once; with them, text that may still turn into a call is held back (from a hermes "<tool_call>" on, or a
    llama3_json reply that starts like JSON) and the calls go out as one tool_calls delta when the reply ends."""

    def __init__(self, index, plan=None):
        self.index, self.plan = index, plan if plan is not None and plan.parse else None
        self.text, self.sent = (plan.prefix if plan is not None else ""), 0  # a forced prefix looks like a call: held

    def push(self, delta):
        """A text delta -> the choice deltas that can go out now (maybe none)."""
        self.text += delta
        upto = len(self.text) if self.plan is None else max(self.sent, self._safe())
        out, self.sent = self.text[self.sent : upto], upto
        return [_delta(self.index, {"content": out})] if out else []

    def end(self, finish_reason, logprobs=None):
        """The reply ended -> its last choice deltas: held-back text or the calls, and the finish_reason."""
        return final_deltas(self.index, _read(self.text, self.plan), finish_reason, logprobs, self.sent)

    def _safe(self):
        """How much of the text cannot be part of a call."""
        if self.plan.format == "hermes":
            at = self.text.find("<tool_call>")
            if at >= 0:
                return at
            tail = next((k for k in range(len("<tool_call>") - 1, 0, -1) if self.text.endswith("<tool_call>"[:k])), 0)
            return len(self.text) - tail
        if self.sent:  # llama3_json: text went out, so the reply is text
            return len(self.text)
        head = self.text.lstrip()
        if not head or head.startswith(("{", PYTHON_TAG)) or PYTHON_TAG.startswith(head):
            return 0
        return len(self.text)
