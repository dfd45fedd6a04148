"""Tool-call markup and the tool runner (nanorl/toolcalls.py): the one reader of <|python_start|>...<|output_end|>."""

from nanorl.tokenizer import SPLIT_PATTERN, Tokenizer
from nanorl.toolcalls import MarkupStream, ToolMarkup, assistant_parts, calculator, run_tool

# a byte-level tokenizer needs no training: 256 byte tokens + the 9 special tokens
TOK = Tokenizer.from_ranks({bytes([i]): i for i in range(256)}, SPLIT_PATTERN)
SP = TOK.encode_special
PY_START, PY_END = SP("<|python_start|>"), SP("<|python_end|>")
OUT_START, OUT_END = SP("<|output_start|>"), SP("<|output_end|>")
A_END = SP("<|assistant_end|>")


def test_render_helpers():
    conv = {
        "messages": [
            {"role": "user", "content": "hi"},
            {
                "role": "assistant",
                "content": [
                    {"type": "text", "text": "sum: "},
                    {"type": "python", "text": "2+3"},
                    {"type": "python_output", "text": "5"},
                    {"type": "text", "text": " done é"},
                ],
            },
        ]
    }
    ids, mask = TOK.render_conversation(conv)
    reply = ids[ids.index(SP("<|assistant_start|>")) + 1 :]
    assert assistant_parts(TOK, reply) == conv["messages"][1]["content"]
    ms = MarkupStream(TOK, inline=True)
    assert "".join(ms.text(t) for t in reply) + ms.text_flush() == "sum: <<2+3=5>> done é"


def test_calculator():
    # the default tool is nanorl.execution's calculator (it has its own tests); here, through run_tool
    assert run_tool("2+3") == "5"
    assert run_tool('"strawberry".count("r")', tool=calculator) == "3"
    assert run_tool("(7 - 1) * 3 / 4", tool=calculator) == "4.5"
    assert run_tool("2 ** 10 % 1000", tool=calculator) == "24"
    for bad in [
        "__import__('os').system('ls')",
        "open('x')",
        "2 ** 10 ** 10",
        "(10**999)**9",
        "x + 1",
        "",
        "'a' * 10**9",
        "1/0",
        "(" * 500 + ")" * 500,
    ]:
        assert run_tool(bad, tool=calculator).startswith("Error"), bad
    assert run_tool("[].count(1)").startswith("Error")
    assert run_tool("1", tool=lambda e: 1 / 0).startswith("Error: ZeroDivisionError")


def test_open_call_and_output_tokens():
    m = ToolMarkup(TOK)
    enc = TOK.encode
    assert m.open_call([*enc("x "), PY_START, *enc("2+3"), PY_END]) == "2+3"
    assert m.open_call([PY_START, PY_END]) == ""  # an empty call is a call
    assert m.open_call([*enc("hi"), PY_END]) is None  # nothing opened
    answered = [PY_START, *enc("1"), PY_END, *m.output_tokens("1"), PY_END]
    assert m.open_call(answered) is None  # the last call was already closed and answered
    assert m.open_call([PY_START, *enc("1"), PY_START, *enc("4*2"), PY_END]) == "4*2"  # the latest opening counts
    assert m.output_tokens("5") == [OUT_START, ord("5"), OUT_END]


def test_markup_stream_pieces_hold_split_characters():
    reply = [*TOK.encode("a é"), PY_START, *TOK.encode("1+1"), PY_END, OUT_START, ord("2"), OUT_END, A_END, ord("z")]
    s = MarkupStream(TOK)
    pieces = []
    for t in reply:
        out = s.push(t)
        if t == TOK.encode("é")[0]:
            assert out == []  # the first byte of a two-byte character is held back
        pieces += out
    pieces += s.flush()
    merged = []
    for k, t in pieces:
        if merged and merged[-1][0] == k and t:
            merged[-1] = (k, merged[-1][1] + t)
        elif t:
            merged.append((k, t))
    assert merged == [("text", "a é"), ("python", "1+1"), ("python_output", "2"), ("text", "z")]
    inline = MarkupStream(TOK, inline=True)
    assert "".join(inline.text(t) for t in reply) + inline.text_flush() == "a é<<1+1=2>>z"
    assert assistant_parts(TOK, reply) == [
        {"type": "text", "text": "a é"},
        {"type": "python", "text": "1+1"},
        {"type": "python_output", "text": "2"},
    ]  # stops at <|assistant_end|>
    assert assistant_parts(TOK, [PY_START, PY_END]) == [{"type": "python", "text": ""}]


def test_a_tokenizer_without_tool_tokens():
    # an open model's tokenizer may have no tool tokens (encode_special gives None): nothing None is watched
    class NoTools:
        def encode_special(self, name):
            return {"<|assistant_end|>": 7}.get(name)

        def get_bos_token_id(self):
            return None

    m = ToolMarkup(NoTools())
    assert m.stops == {7} and m.python_end is None and m.open_call([1, 2, 3]) is None
