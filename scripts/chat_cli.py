"""
Chat with a checkpoint in the terminal, on the sampling engine (tool calls show as <<expr=result>>).

    python -m scripts.chat_cli -i sft                            # interactive; /help lists the commands
    python -m scripts.chat_cli -i rl -p "What is 17 * 23?"       # one shot
    python -m scripts.chat_cli -i base -p "The capital of France"  # a base model continues plain text

At the prompt the arrow keys edit the line and walk the history (readline; kept in $NANORL_BASE_DIR/chat_history),
Ctrl-C clears the line, and Ctrl-C during a reply stops it. When the conversation and a reply no longer fit the
context, the oldest turns are left out (as the web page does), and the CLI says so once.
"""

import atexit
import contextlib
import os
import signal
import sys

from nanorl.engine import Engine, Request
from nanorl.errors import BadValue
from nanorl.flags import ArgumentParser, number_in, tag_name
from nanorl.logger import print0
from nanorl.openai_api import reply_reserve
from nanorl.toolcalls import MarkupStream, assistant_parts

COMMANDS = {
    "/help": "list these commands",
    "/clear": "start a new conversation (plain 'clear' works too)",
    "/temperature X": "sample at temperature X from now on (0 = greedy, at most 2); without X: show it",
    "/quit": "leave (so do 'quit', 'exit' and Ctrl-D)",
}


class TooLong(BadValue):
    """One message that cannot fit the context whatever is left out."""


def turns_to_drop(messages, size, budget):
    """The fewest oldest user/assistant pairs to leave out of messages (which end in the new user message) so that
    size(the rest) <= budget; None when even the last message alone is over budget. size measures tokens."""
    for pairs in range((len(messages) - 1) // 2 + 1):
        if size(messages[2 * pairs :]) <= budget:
            return pairs
    return None


def fit_prompt(tokenizer, messages, max_len, reserve, base=False):
    """-> (prompt ids, pairs left out): the oldest turns go until reserve tokens fit beside the prompt; when only the
    last message is left and it still leaves less than reserve, it goes with the room there is. Raises TooLong when
    the message alone leaves no room for one token."""
    if base:  # a base model never saw chat tokens: it continues the last message's text

        def render(msgs):
            return tokenizer.encode(msgs[-1]["content"], prepend="<|bos|>")
    else:

        def render(msgs):
            return tokenizer.render_for_completion({"messages": msgs})

    pairs = turns_to_drop(messages, lambda msgs: len(render(msgs)), max_len - reserve)
    pairs = (len(messages) - 1) // 2 if pairs is None else pairs
    ids = render(messages[2 * pairs :])
    if len(ids) >= max_len:
        raise TooLong(f"this message alone is {len(ids)} tokens (context {max_len}): shorten it")
    return ids, pairs


def chat_turn(
    engine, tokenizer, conversation, base=False, temperature=0.6, top_k=50, max_tokens=512, seed=None, out=sys.stdout
):
    """Stream the reply to the conversation's last user message to `out`; returns the assistant message. The oldest
    turns that no longer fit beside a reply are deleted from conversation["messages"]."""
    ids, pairs = fit_prompt(
        tokenizer, conversation["messages"], engine.max_len, reply_reserve(max_tokens, engine.max_len), base
    )
    del conversation["messages"][: 2 * pairs]
    req = Request(
        ids,
        max_tokens=min(max_tokens, engine.max_len - len(ids)),
        temperature=temperature,
        top_k=top_k,
        seed=seed,
        stop_tokens=[tokenizer.get_bos_token_id()] if base else None,
    )
    text, tokens = MarkupStream(tokenizer, inline=True), []
    events = engine.stream(req)
    try:
        for ev in events:
            if "token" in ev:
                tokens.append(ev["token"])
                out.write(text.text(ev["token"]))
                out.flush()
            elif ev["status"] == "truncated":
                out.write(text.text_flush() + " [truncated]")
    finally:
        events.close()  # on Ctrl-C: cancels the request
    out.write(text.text_flush() + "\n")
    return {"role": "assistant", "content": assistant_parts(tokenizer, tokens)}


def line_editing(path):
    """input() gets line editing and a history that persists in path (readline: absent on some platforms, then
    input() stays plain)."""
    try:
        import readline
    except ImportError:
        return
    try:
        readline.read_history_file(path)
    except OSError:  # the first session, or an unreadable file: start with no history
        pass
    readline.set_history_length(1000)

    def save():
        try:
            readline.write_history_file(path)
        except OSError:
            pass

    atexit.register(save)


def command(line, settings):
    """A /command (or the plain words kept from before) -> "quit", "clear", or a line to print; None: not a
    command, the line goes to the model. Changes settings in place (/temperature)."""
    word, _, arg = line.partition(" ")
    arg = arg.strip()
    if line in ("quit", "exit") or word in ("/quit", "/exit"):
        return "quit"
    if line == "clear" or word == "/clear":
        return "clear"
    if word == "/help":
        return "\n".join(f"  {name:<16} {what}" for name, what in COMMANDS.items())
    if word == "/temperature":
        if not arg:
            return f"temperature is {settings['temperature']}"
        try:
            t = float(arg)
        except ValueError:
            t = -1.0
        if not 0.0 <= t <= 2.0:
            return f"/temperature takes a number from 0 to 2, got {arg!r}"
        settings["temperature"] = t
        return f"temperature is now {t}"
    if word.startswith("/") and len(word) > 1:
        return f"unknown command {word}: /help lists the commands"
    return None


def loaded_what(args, meta):
    """Which checkpoint the banner names: source, tag and step, or the Hugging Face directory."""
    if args.hf_model is not None:
        return f"Hugging Face model {args.hf_model}"
    from nanorl.checkpoint import find_last_step
    from nanorl.model_loading import find_checkpoint_dir

    step = args.model_step
    if step is None:
        step = find_last_step(find_checkpoint_dir(args.source, meta.get("model_tag")))
    return f"{args.source} checkpoint {meta.get('model_tag')!r}, step {step}"


def chat_loop(engine, tokenizer, settings, banner):
    """The interactive session: commands, turns, and leaving out the oldest turns once the context is full."""
    base = settings["base"]
    print(f"{banner}\n/help lists the commands; 'quit' or Ctrl-D leaves, Ctrl-C clears the line.")
    conversation, told = {"messages": []}, False
    while True:
        try:
            user = input("\nUser: ").strip()
        except KeyboardInterrupt:  # Ctrl-C: drop what was typed, ask again
            print()
            continue
        except EOFError:  # Ctrl-D
            print()
            return
        said = command(user, settings)
        if said == "quit":
            return
        if said == "clear":
            conversation, told = {"messages": []}, False
            print("(a new conversation)")
            continue
        if said is not None:
            print(said)
            continue
        if not user:
            continue
        conversation["messages"].append({"role": "user", "content": user})
        before = len(conversation["messages"])
        print("\nCompletion: " if base else "\nAssistant: ", end="", flush=True)
        try:
            reply = chat_turn(engine, tokenizer, conversation, **settings)
        except KeyboardInterrupt:
            print(" [interrupted]")
            conversation["messages"].pop()
            continue
        except TooLong as e:
            print(f"\n{e}")
            conversation["messages"].pop()
            continue
        left_out = (before - len(conversation["messages"])) // 2
        if left_out and not told:  # once a conversation: from here on every turn may push out the oldest
            told = True
            print(
                f"({left_out} earliest turn{'s' * (left_out > 1)} left out: the conversation no longer fits the "
                f"context of {engine.max_len} tokens; older turns keep being left out as it goes on)"
            )
        # a base model has no turns: each prompt starts fresh
        conversation["messages"] = [] if base else conversation["messages"] + [reply]


def main():
    parser = ArgumentParser(description="Chat with a nanorl model")
    parser.add_argument(
        "-i", "--source", type=str, default="sft", choices=["base", "mid", "sft", "rl"], help="which model"
    )
    parser.add_argument(
        "-g",
        "--model-tag",
        type=tag_name,
        default=None,
        help="checkpoint subdirectory (default: the one saved most recently; named when there are several)",
    )
    parser.add_argument(
        "-s",
        "--model-step",
        "--step",
        type=number_in(int, 0),
        default=None,
        help="checkpoint step; None picks the last",
    )
    parser.add_argument(
        "--hf-model",
        type=str,
        default=None,
        metavar="DIR",
        help="chat with a Hugging Face model directory instead of --source",
    )
    parser.add_argument("-p", "--prompt", type=str, default=None, help="one-shot: answer this and exit")
    parser.add_argument(
        "-t", "--temperature", type=number_in(float, 0.0, 2.0), default=0.6, help="sampling temperature, 0 = greedy"
    )
    parser.add_argument(
        "-k", "--top-k", type=number_in(int, 1), default=50, help="sample from the k most likely tokens"
    )
    parser.add_argument(
        "-m", "--max-tokens", type=number_in(int, 1), default=512, help="the most tokens a reply may have"
    )
    parser.add_argument("--seed", type=int, default=None, help="sampling seed; None draws one")
    parser.add_argument(
        "--device-type", type=str, default=None, choices=["cuda", "cpu", "mps"], help="None detects the device"
    )
    args = parser.parse_args()

    from nanorl.common import compute_init, get_base_dir

    try:
        from nanorl.model_loading import load_model
    except ImportError as e:
        sys.exit(f"chat_cli needs nanorl/model_loading.py (load_model), which this checkout does not have yet ({e})")
    _, _, _, _, device = compute_init(args.device_type)
    # status ("loaded ...", the attention kernels) goes to stderr: stdout is the conversation, so -p can be piped
    with contextlib.redirect_stdout(sys.stderr):
        try:
            model, tokenizer, meta = load_model(
                args.source, device, "eval", args.model_tag, args.model_step, hf_model=args.hf_model
            )
        except (FileNotFoundError, ValueError) as e:
            sys.exit(f"could not load the {args.source} model: {e}")
        engine = Engine(model, tokenizer, batch_size=1)
        print0(engine.attention_kernels())
    settings = dict(
        base=args.source == "base",
        temperature=args.temperature,
        top_k=args.top_k,
        max_tokens=args.max_tokens,
        seed=args.seed,
    )

    if args.prompt is not None:  # a message that cannot fit ends in one line on stderr and exit status 1 (TooLong)
        chat_turn(engine, tokenizer, {"messages": [{"role": "user", "content": args.prompt}]}, **settings)
        return
    line_editing(os.path.join(get_base_dir(), "chat_history"))
    # Ctrl-C clears the line even when we were started with SIGINT ignored (a shell's background job passes that on)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    chat_loop(engine, tokenizer, settings, f"nanorl chat: {loaded_what(args, meta)} (context {engine.max_len} tokens).")


if __name__ == "__main__":
    main()
