"""
BPE tokenizer: trained with rustbpe (fast, Rust), used for encoding through tiktoken (fast, battle tested).
Also renders chat conversations into token ids plus a loss mask.
"""
import base64
import json
import os

SPECIAL_TOKENS = [
    "<|bos|>",  # every document starts with it
    "<|user_start|>", "<|user_end|>",
    "<|assistant_start|>", "<|assistant_end|>",
    "<|python_start|>", "<|python_end|>",  # the assistant calls the python tool
    "<|output_start|>", "<|output_end|>",  # the tool's output, forced in (never trained on)
]

# GPT-4-style split, with numbers split into groups of at most 2 digits: small vocabularies
# waste fewer tokens on digit triples, and arithmetic stays easier to learn.
SPLIT_PATTERN = r"""'(?i:[sdmt]|ll|ve|re)|[^\r\n\p{L}\p{N}]?+\p{L}+|\p{N}{1,2}| ?[^\s\p{L}\p{N}]++[\r\n]*|\s*[\r\n]|\s+(?!\S)|\s+"""

TOKENIZER_FILE = "tokenizer.json"


class Tokenizer:
    def __init__(self, enc):
        self.enc = enc
        self.bos_token_id = self.encode_special("<|bos|>")

    # --- construction -------------------------------------------------------------------------
    @classmethod
    def from_ranks(cls, mergeable_ranks, pattern):
        import tiktoken
        offset = len(mergeable_ranks)
        special = {name: offset + i for i, name in enumerate(SPECIAL_TOKENS)}
        enc = tiktoken.Encoding(name="nanorl", pat_str=pattern, mergeable_ranks=mergeable_ranks, special_tokens=special)
        return cls(enc)

    @classmethod
    def train(cls, text_iterator, vocab_size):
        import rustbpe  # only needed to train, not to use
        n_merged = vocab_size - len(SPECIAL_TOKENS)
        if n_merged < 256:
            raise ValueError(f"--vocab-size {vocab_size} is too small: need >= {256 + len(SPECIAL_TOKENS)} (256 bytes + special tokens)")
        tok = rustbpe.Tokenizer()
        tok.train_from_iterator(text_iterator, n_merged, pattern=SPLIT_PATTERN)
        ranks = {bytes(k): v for k, v in tok.get_mergeable_ranks()}
        return cls.from_ranks(ranks, tok.get_pattern())

    @classmethod
    def load(cls, directory):
        path = os.path.join(directory, TOKENIZER_FILE)
        if not os.path.exists(path):
            raise FileNotFoundError(f"no tokenizer at {path}: train one first with `python -m scripts.tok_train`")
        try:
            with open(path) as f:
                data = json.load(f)
            ranks = {base64.b64decode(k): int(v) for k, v in data["mergeable_ranks"]}
            pattern = data["pattern"]
        except (json.JSONDecodeError, KeyError, ValueError, TypeError) as e:
            raise ValueError(f"tokenizer file {path} is corrupt ({type(e).__name__}: {e}); retrain it with `python -m scripts.tok_train`") from e
        if data.get("special_tokens", SPECIAL_TOKENS) != SPECIAL_TOKENS:
            raise ValueError(f"tokenizer file {path} has different special tokens than this version of nanorl")
        if sorted(ranks.values()) != list(range(len(ranks))):
            raise ValueError(f"tokenizer file {path} is corrupt: its token ranks are not 0..{len(ranks) - 1}")
        return cls.from_ranks(ranks, pattern)

    def save(self, directory):
        os.makedirs(directory, exist_ok=True)
        path = os.path.join(directory, TOKENIZER_FILE)
        ranks = sorted(self.enc._mergeable_ranks.items(), key=lambda kv: kv[1])
        data = {"pattern": self.enc._pat_str, "special_tokens": SPECIAL_TOKENS,
                "mergeable_ranks": [[base64.b64encode(k).decode("ascii"), v] for k, v in ranks]}
        tmp = path + ".tmp"
        with open(tmp, "w") as f:  # temp file + rename: a crash never leaves a half-written tokenizer
            json.dump(data, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        return path

    # --- encoding -----------------------------------------------------------------------------
    @property
    def vocab_size(self):
        return self.enc.n_vocab

    def encode_special(self, name):
        return self.enc.encode_single_token(name)

    def get_bos_token_id(self):
        return self.bos_token_id

    def encode(self, text, prepend=None, append=None, num_threads=8):
        """Encode a str (-> list of ids) or a list of str (-> list of lists). Special tokens in text are plain text."""
        pre = [self.encode_special(prepend) if isinstance(prepend, str) else prepend] if prepend is not None else []
        post = [self.encode_special(append) if isinstance(append, str) else append] if append is not None else []
        if isinstance(text, str):
            return pre + self.enc.encode_ordinary(text) + post
        if isinstance(text, list):
            out = self.enc.encode_ordinary_batch(text, num_threads=num_threads)
            return [pre + ids + post for ids in out]
        raise TypeError(f"encode takes a str or a list of str, got {type(text).__name__}")

    def __call__(self, *args, **kwargs):
        return self.encode(*args, **kwargs)

    def decode(self, ids):
        return self.enc.decode(ids)

    def id_to_token(self, i):
        return self.enc.decode([i])

    def token_bytes(self):
        """Bytes per token id (0 for special tokens), for bits-per-byte: a loss that does not depend on the vocab."""
        special = set(self.enc.special_tokens_set)
        out = []
        for i in range(self.vocab_size):
            tok = self.enc.decode_single_token_bytes(i)
            out.append(0 if tok.decode("utf-8", errors="replace") in special else len(tok))
        return out

    # --- chat ---------------------------------------------------------------------------------
    def render_conversation(self, conversation, max_tokens=None):
        """
        Conversation -> (ids, mask). mask is 1 on what the assistant writes (its text, its tool calls, its
        <|assistant_end|>), 0 on everything else (bos, user turns, tool outputs). A system message is
        folded into the first user message (the model has no separate system role).
        """
        messages = validate_conversation(conversation)
        if messages[0]["role"] == "system":
            messages = [{"role": "user", "content": messages[0]["content"] + "\n\n" + messages[1]["content"]}] + messages[2:]
        ids, mask = [], []

        def add(toks, m):
            toks = [toks] if isinstance(toks, int) else toks
            ids.extend(toks)
            mask.extend([m] * len(toks))

        add(self.bos_token_id, 0)
        for msg in messages:
            if msg["role"] == "user":
                add(self.encode_special("<|user_start|>"), 0)
                add(self.encode(msg["content"]), 0)
                add(self.encode_special("<|user_end|>"), 0)
            else:
                add(self.encode_special("<|assistant_start|>"), 0)
                for part in content_parts(msg["content"]):
                    if part["type"] == "text":
                        add(self.encode(part["text"]), 1)
                    elif part["type"] == "python":
                        add(self.encode_special("<|python_start|>"), 1)
                        add(self.encode(part["text"]), 1)
                        add(self.encode_special("<|python_end|>"), 1)
                    else:  # python_output: the tool wrote it, not the model
                        add(self.encode_special("<|output_start|>"), 0)
                        add(self.encode(part["text"]), 0)
                        add(self.encode_special("<|output_end|>"), 0)
                add(self.encode_special("<|assistant_end|>"), 1)
        if max_tokens is not None:
            ids, mask = ids[:max_tokens], mask[:max_tokens]
        return ids, mask

    def render_for_completion(self, conversation):
        """Prompt ids for the model to write the next assistant turn: drop a final assistant message, open a new one."""
        messages = list(conversation["messages"])
        if messages and messages[-1]["role"] == "assistant":
            messages = messages[:-1]
        # render with a placeholder assistant turn (so validation passes), then cut it off
        ids, _ = self.render_conversation({"messages": messages + [{"role": "assistant", "content": ""}]})
        return ids[:-1]  # keep <|assistant_start|>, drop <|assistant_end|>

    def visualize(self, ids, mask):
        """Debug view: trained-on tokens in green."""
        return "".join(f"\033[92m{self.id_to_token(i)}\033[0m" if m else self.id_to_token(i) for i, m in zip(ids, mask))


def content_parts(content):
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    return content


def validate_conversation(conversation):
    """Check roles and content; raise a ValueError naming the message at fault."""
    if not isinstance(conversation, dict) or not isinstance(conversation.get("messages"), list):
        raise ValueError("a conversation is a dict with a 'messages' list")
    messages = conversation["messages"]
    if not messages:
        raise ValueError("conversation has no messages")
    start = 1 if messages[0].get("role") == "system" else 0
    if start == 1 and len(messages) < 2:
        raise ValueError("conversation has a system message but no user message after it")
    for i, msg in enumerate(messages):
        role = msg.get("role")
        if i < start:
            if not isinstance(msg.get("content"), str):
                raise ValueError(f"message {i}: system content must be a string")
            continue
        expected = "user" if (i - start) % 2 == 0 else "assistant"
        if role != expected:
            raise ValueError(f"message {i}: role {role!r}, expected {expected!r} (roles must alternate user/assistant, starting with user)")
        content = msg.get("content")
        if role == "user" and not isinstance(content, str):
            raise ValueError(f"message {i}: user content must be a string")
        if role == "assistant":
            if not isinstance(content, (str, list)):
                raise ValueError(f"message {i}: assistant content must be a string or a list of parts")
            for j, part in enumerate(content_parts(content)):
                if not isinstance(part, dict) or part.get("type") not in ("text", "python", "python_output") or not isinstance(part.get("text"), str):
                    raise ValueError(f"message {i} part {j}: each part is {{'type': 'text'|'python'|'python_output', 'text': str}}, got {part!r}")
    return messages


def get_tokenizer(base_dir=None):
    from nanorl.common import get_base_dir
    return Tokenizer.load(os.path.join(base_dir or get_base_dir(), "tokenizer"))


def get_token_bytes(tokenizer, device="cpu"):
    import torch
    return torch.tensor(tokenizer.token_bytes(), dtype=torch.int32, device=device)
