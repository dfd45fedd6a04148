import itertools
import json

import pytest

from nanorl import synthetic
from nanorl.tokenizer import SPECIAL_TOKENS, Tokenizer


@pytest.fixture(scope="module")
def tok():
    docs = itertools.islice(synthetic.pretrain_documents("train", seed=0), 400)
    return Tokenizer.train(docs, vocab_size=1024)


def test_trains_on_synthetic_text(tok):
    assert tok.vocab_size == 1024
    assert [tok.encode_special(s) for s in SPECIAL_TOKENS] == list(range(1024 - len(SPECIAL_TOKENS), 1024))
    text = next(synthetic.pretrain_documents("test", seed=1))
    # BPE actually merged: well under one token per byte on in-domain text
    assert len(tok.encode(text)) < 0.5 * len(text.encode("utf-8"))


@pytest.mark.parametrize(
    "text",
    [
        "hello world",
        "",
        "  spaces\n\nand\ttabs ",
        "ünïcödé ✓ 日本語 🤖🚀",
        "numbers 1234567 3.14159 -42",
        "<|bos|> is plain text here",
        "a" * 500,
    ],
)
def test_roundtrip(tok, text):
    ids = tok.encode(text)
    assert tok.decode(ids) == text
    assert all(0 <= i < tok.vocab_size for i in ids)


def test_special_tokens_are_not_produced_by_text(tok):
    ids = tok.encode("<|bos|><|assistant_end|>")
    assert tok.get_bos_token_id() not in ids
    assert tok.encode("hi", prepend="<|bos|>")[0] == tok.get_bos_token_id()
    batch = tok.encode(["ab", "cd"], prepend="<|bos|>", append="<|assistant_end|>")
    assert all(b[0] == tok.get_bos_token_id() and b[-1] == tok.encode_special("<|assistant_end|>") for b in batch)


def test_conversation_masks_with_tool_call(tok):
    conv = {
        "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "What is 3*4+1?"},
            {
                "role": "assistant",
                "content": [
                    {"type": "text", "text": "First "},
                    {"type": "python", "text": "3*4"},
                    {"type": "python_output", "text": "12"},
                    {"type": "text", "text": " then 13.\n#### 13"},
                ],
            },
        ]
    }
    ids, mask = tok.render_conversation(conv)
    assert len(ids) == len(mask)
    sp = {s: tok.encode_special(s) for s in SPECIAL_TOKENS}
    # build the expected sequence by hand
    exp_ids, exp_mask = [sp["<|bos|>"]], [0]

    def add(x, m):
        exp_ids.extend(x)
        exp_mask.extend([m] * len(x))

    add([sp["<|user_start|>"]] + tok.encode("Be brief.\n\nWhat is 3*4+1?") + [sp["<|user_end|>"]], 0)
    add([sp["<|assistant_start|>"]], 0)
    add(tok.encode("First "), 1)
    add([sp["<|python_start|>"]] + tok.encode("3*4") + [sp["<|python_end|>"]], 1)
    add([sp["<|output_start|>"]] + tok.encode("12") + [sp["<|output_end|>"]], 0)
    add(tok.encode(" then 13.\n#### 13") + [sp["<|assistant_end|>"]], 1)
    assert ids == exp_ids and mask == exp_mask
    # the masked-in tokens decode to exactly what the assistant wrote itself
    own = tok.decode([i for i, m in zip(ids, mask) if m])
    assert own == "First <|python_start|>3*4<|python_end|> then 13.\n#### 13<|assistant_end|>"
    prompt = tok.render_for_completion(conv)
    assert prompt == ids[: ids.index(sp["<|assistant_start|>"]) + 1]


@pytest.mark.parametrize(
    "conv,msg",
    [
        ({"messages": []}, "no messages"),
        ({"messages": [{"role": "assistant", "content": "hi"}]}, "expected 'user'"),
        ({"messages": [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]}, "message 1"),
        ({"messages": [{"role": "user", "content": "a"}, {"role": "bot", "content": "b"}]}, "role 'bot'"),
        (
            {"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": [{"type": "img"}]}]},
            "part 0",
        ),
        ("not a dict", "dict"),
    ],
)
def test_bad_conversations(tok, conv, msg):
    with pytest.raises(ValueError, match=msg):
        tok.render_conversation(conv)


def test_save_load_identical(tok, tmp_path):
    tok.save(tmp_path)
    tok2 = Tokenizer.load(tmp_path)
    texts = [next(synthetic.pretrain_documents("test", seed=s)) for s in range(3)] + ["ünïcödé 🤖"]
    assert [tok.encode(t) for t in texts] == [tok2.encode(t) for t in texts]
    assert tok2.vocab_size == tok.vocab_size
    assert tok.token_bytes() == tok2.token_bytes()
    assert tok.token_bytes()[tok.get_bos_token_id()] == 0


def test_missing_and_corrupt_files(tmp_path):
    with pytest.raises(FileNotFoundError, match="tok_train"):
        Tokenizer.load(tmp_path)
    (tmp_path / "tokenizer.json").write_text('{"pattern": "x", "mergeable_ranks": [[')
    with pytest.raises(ValueError, match="corrupt"):
        Tokenizer.load(tmp_path)
    (tmp_path / "tokenizer.json").write_text(json.dumps({"pattern": "x", "mergeable_ranks": [["YQ==", 5]]}))
    with pytest.raises(ValueError, match="corrupt"):
        Tokenizer.load(tmp_path)


def test_vocab_too_small():
    with pytest.raises(ValueError, match="vocab-size"):
        Tokenizer.train(iter(["abc"]), vocab_size=100)
