"""
BPE tokenizer: trained with rustbpe (fast, Rust), used for encoding through tiktoken (fast, battle tested).
Also renders chat conversations into token ids plus a loss mask.
"""

import base64
import json
import os
import tempfile

from nanorl.errors import BadValue, MissingFile, read_json_object

SPECIAL_TOKENS = [
    "<|bos|>",  # every document starts with it
    "<|user_start|>",
    "<|user_end|>",
    "<|assistant_start|>",
    "<|assistant_end|>",
    "<|python_start|>",
    "<|python_end|>",  # the assistant calls the python tool
    "<|output_start|>",
    "<|output_end|>",  # the tool's output, forced in (never trained on)
]

# GPT-4-style split, with numbers split into groups of at most 2 digits: small vocabularies
# waste fewer tokens on digit triples, and arithmetic stays easier to learn.
SPLIT_PATTERN = (
    r"""'(?i:[sdmt]|ll|ve|re)|[^\r\n\p{L}\p{N}]?+\p{L}+|\p{N}{1,2}| ?[^\s\p{L}\p{N}]++[\r\n]*|\s*[\r\n]|\s+(?!\S)|\s+"""
)

TOKENIZER_FILE = "tokenizer.json"


def _is_ours(path):
    """Whether path holds a tokenizer Tokenizer.save wrote (its keys), not a Hugging Face one or anything else."""
    try:
        with open(path) as f:
            data = json.load(f)
    except (OSError, ValueError):
        return False
    return isinstance(data, dict) and {"pattern", "special_tokens", "mergeable_ranks"} <= set(data)


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
            raise BadValue(
                f"--vocab-size {vocab_size} is too small: need >= {256 + len(SPECIAL_TOKENS)} (256 bytes + special tokens)"
            )
        tok = rustbpe.Tokenizer()
        tok.train_from_iterator(text_iterator, n_merged, pattern=SPLIT_PATTERN)
        ranks = {bytes(k): v for k, v in tok.get_mergeable_ranks()}
        return cls.from_ranks(ranks, tok.get_pattern())

    @classmethod
    def load(cls, directory):
        path = os.path.join(directory, TOKENIZER_FILE)
        if not os.path.exists(path):
            raise MissingFile(f"no tokenizer at {path}: train one first with `python -m scripts.tok_train`")
        try:
            with open(path) as f:
                data = json.load(f)
            ranks = {base64.b64decode(k): int(v) for k, v in data["mergeable_ranks"]}
            pattern = data["pattern"]
        except (json.JSONDecodeError, KeyError, ValueError, TypeError) as e:
            raise BadValue(
                f"tokenizer file {path} is corrupt ({type(e).__name__}: {e}); retrain it with `python -m scripts.tok_train`"
            ) from e
        if data.get("special_tokens", SPECIAL_TOKENS) != SPECIAL_TOKENS:
            raise BadValue(f"tokenizer file {path} has different special tokens than this version of nanorl")
        if sorted(ranks.values()) != list(range(len(ranks))):
            raise BadValue(f"tokenizer file {path} is corrupt: its token ranks are not 0..{len(ranks) - 1}")
        return cls.from_ranks(ranks, pattern)

    def save(self, directory):
        """Write tokenizer.json into directory, replacing only a tokenizer of ours (a Hugging Face tokenizer.json
        there, or any other file of that name, is refused in one line and kept)."""
        os.makedirs(directory, exist_ok=True)
        path = os.path.join(directory, TOKENIZER_FILE)
        if os.path.lexists(path) and not _is_ours(path):
            raise BadValue(
                f"{path} exists and is not a nanorl tokenizer: it is never replaced; move it aside or save elsewhere "
                "(tok_train --out-dir)"
            )
        ranks = sorted(self.enc._mergeable_ranks.items(), key=lambda kv: kv[1])
        data = {
            "pattern": self.enc._pat_str,
            "special_tokens": SPECIAL_TOKENS,
            "mergeable_ranks": [[base64.b64encode(k).decode("ascii"), v] for k, v in ranks],
        }
        fd, tmp = tempfile.mkstemp(dir=directory, prefix=f".{TOKENIZER_FILE}.tmp-")
        try:
            with os.fdopen(fd, "w") as f:  # temp file + rename: a crash never leaves a half-written tokenizer
                json.dump(data, f)
                f.flush()
                os.fsync(f.fileno())
            os.chmod(tmp, 0o644)
            os.replace(tmp, path)
        except BaseException:
            os.remove(tmp)
            raise
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

    def decode_token_bytes(self, i):
        """The bytes of one token (a token may be part of a UTF-8 character)."""
        return self.enc.decode_single_token_bytes(i)

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
            messages = [
                {"role": "user", "content": messages[0]["content"] + "\n\n" + messages[1]["content"]}
            ] + messages[2:]
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
        return truncate(ids, mask, max_tokens)

    def render_for_completion(self, conversation):
        """Prompt ids for the model to write the next assistant turn: drop a final assistant message, open a new one."""
        ids, _ = self.render_conversation(completion_conversation(conversation))
        return ids[:-1]  # keep <|assistant_start|>, drop the placeholder's <|assistant_end|>


def truncate(ids, mask, max_tokens):
    """A rendered conversation's first max_tokens tokens (None: all of them)."""
    return (ids, mask) if max_tokens is None else (ids[:max_tokens], mask[:max_tokens])


def completion_conversation(conversation):
    """The conversation a completion's prompt is rendered from: a final assistant message dropped, and an empty
    assistant turn opened (a placeholder, so the conversation validates, that each tokenizer then cuts off)."""
    messages = list(conversation["messages"])
    if messages and messages[-1]["role"] == "assistant":
        messages = messages[:-1]
    return {"messages": messages + [{"role": "assistant", "content": ""}]}


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
            raise ValueError(
                f"message {i}: role {role!r}, expected {expected!r} (roles must alternate user/assistant, starting with user)"
            )
        content = msg.get("content")
        if role == "user" and not isinstance(content, str):
            raise ValueError(f"message {i}: user content must be a string")
        if role == "assistant":
            if not isinstance(content, (str, list)):
                raise ValueError(f"message {i}: assistant content must be a string or a list of parts")
            for j, part in enumerate(content_parts(content)):
                if (
                    not isinstance(part, dict)
                    or part.get("type") not in ("text", "python", "python_output")
                    or not isinstance(part.get("text"), str)
                ):
                    raise ValueError(
                        f"message {i} part {j}: each part is {{'type': 'text'|'python'|'python_output', 'text': str}}, got {part!r}"
                    )
    return messages


def get_tokenizer(base_dir=None):
    from nanorl.common import get_base_dir

    return Tokenizer.load(os.path.join(base_dir or get_base_dir(), "tokenizer"))


def get_token_bytes(tokenizer, device="cpu"):
    import torch

    return torch.tensor(tokenizer.token_bytes(), dtype=torch.int32, device=device)


# --- open models' tokenizers --------------------------------------------------------------------

# nanorl's names for the tokens the engine, rollouts and scripts ask for, and what each family calls them
CHAT_FORMATS = {
    # Qwen (ChatML): <|endoftext|> separates pretraining documents, <|im_end|> ends a turn
    "<|im_start|>": {"<|bos|>": "<|endoftext|>", "<|assistant_end|>": "<|im_end|>"},
    # Llama-3: header tokens around each role, <|eot_id|> ends a turn
    "<|start_header_id|>": {"<|bos|>": "<|begin_of_text|>", "<|assistant_end|>": "<|eot_id|>"},
}


class HFTokenizer:
    """
    A model's own tokenizer.json (through the `tokenizers` package) behind the Tokenizer interface, with
    conversations rendered by the model's chat template (jinja2, as transformers renders it). Special
    tokens are asked for by nanorl's names and mapped to the family's tokens; names with no counterpart
    (the tool-call tokens of a model without them) give None, and the engine then never sees a tool call.
    """

    def __init__(self, tok, chat_template, special_map, config=None):
        from tokenizers import Tokenizer as HFTok

        self.tok = tok  # added tokens in text are special tokens: what a chat template renders
        self.plain = HFTok.from_str(tok.to_str())  # special-looking text is plain text: what encode() takes
        self.plain.encode_special_tokens = True
        self.chat_template, self.special_map, self.config = chat_template, special_map, config or {}
        self._template = None  # the compiled chat template, made on first use
        self.bos_token_id = self.encode_special("<|bos|>")
        self.assistant_end = self.special_map.get("<|assistant_end|>")
        self.added = {t.content for t in tok.get_added_tokens_decoder().values()}
        self.unicode_to_byte = {c: b for b, c in _bytes_to_unicode().items()}

    @classmethod
    def load(cls, directory):
        from tokenizers import Tokenizer as HFTok

        path = os.path.join(directory, "tokenizer.json")
        if not os.path.exists(path):
            raise MissingFile(f"{path} is missing: the model directory needs its tokenizer.json")
        try:
            tok = HFTok.from_file(path)
        except Exception as e:
            raise BadValue(f"{path} is not a Hugging Face tokenizers file ({type(e).__name__}: {e})") from e
        config = {}
        cfg_path = os.path.join(directory, "tokenizer_config.json")
        if os.path.exists(cfg_path):
            config = read_json_object(cfg_path, "tokenizer config")
        template = config.get("chat_template")
        jinja_path = os.path.join(directory, "chat_template.jinja")  # where newer transformers save it
        if os.path.exists(jinja_path):
            with open(jinja_path) as f:
                template = f.read()
        if isinstance(template, list):  # several named templates: the default one
            template = next(t["template"] for t in template if t.get("name") == "default")
        special_map = {}
        for marker, names in CHAT_FORMATS.items():
            if template and marker in template:
                special_map.update(names)
        for name in ("bos_token", "eos_token"):
            value = config.get(name)
            value = value.get("content") if isinstance(value, dict) else value
            if value and name == "bos_token":
                special_map["<|bos|>"] = value
            if value and name == "eos_token":
                special_map.setdefault("<|assistant_end|>", value)
        special_map.setdefault("<|bos|>", special_map.get("<|assistant_end|>"))
        return cls(tok, template, special_map, config)

    def save(self, directory):
        save_hf_tokenizer(self, directory)

    @property
    def vocab_size(self):
        return self.tok.get_vocab_size(with_added_tokens=True)

    def encode_special(self, name):
        """Id of a special token by nanorl's name (or the model's own), None if this tokenizer has no such token."""
        return self.tok.token_to_id(self.special_map.get(name, name))

    def get_bos_token_id(self):
        return self.bos_token_id

    def encode(self, text, prepend=None, append=None, num_threads=8):
        pre = [self.encode_special(prepend) if isinstance(prepend, str) else prepend] if prepend is not None else []
        post = [self.encode_special(append) if isinstance(append, str) else append] if append is not None else []
        if isinstance(text, str):
            return pre + self.plain.encode(text, add_special_tokens=False).ids + post
        if isinstance(text, list):
            return [pre + e.ids + post for e in self.plain.encode_batch(text, add_special_tokens=False)]
        raise TypeError(f"encode takes a str or a list of str, got {type(text).__name__}")

    def __call__(self, *args, **kwargs):
        return self.encode(*args, **kwargs)

    def decode(self, ids):
        return self.tok.decode(list(ids), skip_special_tokens=False)

    def id_to_token(self, i):
        return self.decode([i])

    def decode_token_bytes(self, i):
        """The bytes of one token: byte-level BPE tokens map back through the byte alphabet, others decode."""
        s = self.tok.id_to_token(i)
        if s is None:
            return b""
        if s in self.added:
            return s.encode("utf-8")
        if all(c in self.unicode_to_byte for c in s):
            return bytes(self.unicode_to_byte[c] for c in s)
        return self.decode([i]).encode("utf-8")

    def token_bytes(self):
        special = {t.content for t in self.tok.get_added_tokens_decoder().values() if t.special}
        return [
            0 if self.tok.id_to_token(i) in special else len(self.decode_token_bytes(i)) for i in range(self.vocab_size)
        ]

    # --- chat ---------------------------------------------------------------------------------
    def apply_template(self, messages, add_generation_prompt, tools=None):
        """The chat template's text, rendered the way transformers' apply_chat_template renders it."""
        if not self.chat_template:
            raise ValueError("this tokenizer has no chat template (no chat_template in tokenizer_config.json)")
        if self._template is None:  # compiled once: compiling is ~90% of a render's time
            self._template = self._compile_template()
        specials = {
            k: (v.get("content") if isinstance(v, dict) else v)
            for k, v in self.config.items()
            if k.endswith("_token") and isinstance(v, (str, dict))
        }
        return self._template.render(
            messages=messages, add_generation_prompt=add_generation_prompt, tools=tools, **specials
        )

    def _compile_template(self):
        import jinja2.sandbox

        env = jinja2.sandbox.ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
        )
        env.filters["tojson"] = lambda x, indent=None, separators=None, sort_keys=False: json.dumps(
            x, ensure_ascii=False, indent=indent, separators=separators, sort_keys=sort_keys
        )

        def raise_exception(message):
            raise ValueError(f"chat template: {message}")

        env.globals["raise_exception"] = raise_exception
        env.globals["strftime_now"] = lambda fmt: __import__("datetime").datetime.now().strftime(fmt)
        return env.from_string(self.chat_template)

    def _messages(self, conversation):
        """nanorl conversation -> template messages. Tool parts need tool tokens this tokenizer lacks, so
        they are written as plain text (a model without tool tokens has no tool calls)."""
        out = []
        for msg in validate_conversation(conversation):
            content = msg["content"]
            if not isinstance(content, str):
                content = "".join(p["text"] for p in content)
            out.append({"role": msg["role"], "content": content})
        return out

    def render_conversation(self, conversation, max_tokens=None):
        """(ids, mask) with mask 1 on each assistant reply up to and including its end-of-turn token, as
        the template renders it; everything the template adds around it (headers, newlines) is 0."""
        messages = self._messages(conversation)
        spans, rendered = [], []
        for i, msg in enumerate(messages):
            if msg["role"] != "assistant":
                continue
            prompt = self.apply_template(messages[:i], add_generation_prompt=True)
            full = self.apply_template(messages[: i + 1], add_generation_prompt=False)
            if not full.startswith(prompt):
                raise ValueError(
                    "the chat template renders an earlier turn differently once a reply follows; "
                    "cannot tell the reply's tokens apart"
                )
            end = full.find(self.special_map.get("<|assistant_end|>") or "\0", len(prompt))
            end = len(full) if end < 0 else end + len(self.special_map["<|assistant_end|>"])
            spans.append((len(prompt), end))
            rendered.append(full[:end])
        text = self.apply_template(messages, add_generation_prompt=False)
        if not all(text.startswith(r) for r in rendered):
            raise ValueError(
                "the chat template renders an earlier reply differently once the conversation goes on "
                "(as Qwen3's drops earlier <think> blocks): train on one reply per conversation"
            )
        enc = self.tok.encode(text, add_special_tokens=False)
        ids = enc.ids
        mask = [int(any(a <= s < b for a, b in spans)) for s, _ in enc.offsets]
        return truncate(ids, mask, max_tokens)

    def render_for_completion(self, conversation):
        messages = self._messages(completion_conversation(conversation))[:-1]  # the template opens the turn itself
        return self.tok.encode(self.apply_template(messages, add_generation_prompt=True), add_special_tokens=False).ids

    def render_messages(self, messages, tools=None, add_generation_prompt=True, reply_prefix=""):
        """OpenAI-style messages (tool calls, tool results) and tools, rendered by the template as they are -> ids,
        for function calling (nanorl/function_calls.py). The template itself checks the roles' order. reply_prefix:
        text that opens the assistant's reply (a forced tool call); its tool tokens are the tokenizer's added tokens."""
        try:
            text = self.apply_template(messages, add_generation_prompt, tools=tools or None)
        except ValueError:
            raise
        except Exception as e:  # jinja's own errors: a message without a field the template reads, ...
            raise ValueError(f"the chat template cannot render these messages ({type(e).__name__}: {e})") from e
        return self.tok.encode(text + reply_prefix, add_special_tokens=False).ids


# nanorl's own conversation format as a chat template, for exported nanorl models
NANORL_CHAT_TEMPLATE = (
    "{{ bos_token }}{% set ns = namespace(system='') %}"
    "{% for m in messages %}{% if m['role'] == 'system' %}{% set ns.system = m['content'] + '\n\n' %}"
    "{% elif m['role'] == 'user' %}<|user_start|>{{ ns.system }}{{ m['content'] }}<|user_end|>{% set ns.system = '' %}"
    "{% else %}<|assistant_start|>{{ m['content'] }}<|assistant_end|>{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant_start|>{% endif %}"
)


def _bytes_to_unicode():
    # byte-level BPE's printable stand-in for each byte (GPT-2's table, which HF's ByteLevel uses)
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, (chr(c) for c in cs)))


def save_hf_tokenizer(tokenizer, directory):
    """Write tokenizer.json (HF `tokenizers` format) + tokenizer_config.json (with the chat template)."""
    if isinstance(tokenizer, HFTokenizer):
        tokenizer.tok.save(os.path.join(directory, "tokenizer.json"))
        config = dict(tokenizer.config)
        config["chat_template"] = tokenizer.chat_template
    else:
        from tokenizers import Regex, decoders, models, pre_tokenizers
        from tokenizers import Tokenizer as HFTok

        b2u = _bytes_to_unicode()
        ranks = tokenizer.enc._mergeable_ranks
        vocab = {"".join(b2u[b] for b in tok): r for tok, r in ranks.items()}
        # tiktoken merges the pair whose result has the lowest rank: list each token's split into two
        # lower-ranked tokens in rank order, and HF's BPE makes the same merges
        merges = []
        for tok, r in sorted(ranks.items(), key=lambda kv: kv[1]):
            if len(tok) < 2:
                continue
            for k in range(1, len(tok)):
                a, b = tok[:k], tok[k:]
                if a in ranks and b in ranks and ranks[a] < r and ranks[b] < r:
                    merges.append(("".join(b2u[x] for x in a), "".join(b2u[x] for x in b)))
        hf = HFTok(models.BPE(vocab=vocab, merges=merges, ignore_merges=True))
        hf.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(tokenizer.enc._pat_str), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
        hf.decoder = decoders.ByteLevel()
        hf.add_special_tokens(SPECIAL_TOKENS)
        assert [hf.token_to_id(t) for t in SPECIAL_TOKENS] == [tokenizer.encode_special(t) for t in SPECIAL_TOKENS]
        hf.save(os.path.join(directory, "tokenizer.json"))
        config = {
            "bos_token": "<|bos|>",
            "eos_token": "<|assistant_end|>",
            "pad_token": "<|assistant_end|>",  # as generation_config.json's pad id (nanorl/hf.py: token_ids)
            "chat_template": NANORL_CHAT_TEMPLATE,
            "tokenizer_class": "PreTrainedTokenizerFast",
        }
    with open(os.path.join(directory, "tokenizer_config.json"), "w") as f:
        json.dump(config, f, indent=2)
