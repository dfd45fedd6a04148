"""
Chat with a checkpoint in the terminal, on the sampling engine (tool calls show as <<expr=result>>).

    python -m scripts.chat_cli -i sft                            # interactive; 'clear' starts over, 'quit' or Ctrl-D leaves
    python -m scripts.chat_cli -i rl -p "What is 17 * 23?"       # one shot
    python -m scripts.chat_cli -i base -p "The capital of France"  # a base model continues plain text

At the prompt the arrow keys edit the line and walk the history (readline; kept in $NANORL_BASE_DIR/chat_history),
Ctrl-C clears the line, and Ctrl-C during a reply stops it.
"""
import atexit
import os
import signal
import sys

from nanorl.common import ArgumentParser, number_in, print0
from nanorl.engine import Engine, Request
from nanorl.toolcalls import MarkupStream, assistant_parts


def prompt_ids(tokenizer, conversation, base):
    # a base model never saw chat tokens: it continues the text; chat models get the rendered conversation
    if base:
        return tokenizer.encode(conversation["messages"][-1]["content"], prepend="<|bos|>")
    return tokenizer.render_for_completion(conversation)


def chat_turn(engine, tokenizer, conversation, base=False, temperature=0.6, top_k=50, max_tokens=512, seed=None, out=sys.stdout):
    """Stream the reply to the conversation's last user message to `out`; returns the assistant message."""
    ids = prompt_ids(tokenizer, conversation, base)
    room = engine.max_len - len(ids)
    if room < 1:
        raise ValueError(f"the conversation ({len(ids)} tokens) has filled the context of {engine.max_len}: type 'clear'")
    req = Request(ids, max_tokens=min(max_tokens, room), temperature=temperature, top_k=top_k, seed=seed,
                  stop_tokens=[tokenizer.get_bos_token_id()] if base else None)
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


def main():
    parser = ArgumentParser(description="Chat with a nanorl model")
    parser.add_argument("-i", "--source", type=str, default="sft", choices=["base", "mid", "sft", "rl"], help="which model")
    parser.add_argument("-g", "--model-tag", type=str, default=None, help="model tag; None picks the largest")
    parser.add_argument("-s", "--model-step", "--step", type=number_in(int, 0), default=None, help="checkpoint step; None picks the last")
    parser.add_argument("--hf-model", type=str, default=None, metavar="DIR", help="chat with a Hugging Face model directory instead of --source")
    parser.add_argument("-p", "--prompt", type=str, default=None, help="one-shot: answer this and exit")
    parser.add_argument("-t", "--temperature", type=number_in(float, 0.0, 2.0), default=0.6, help="sampling temperature, 0 = greedy")
    parser.add_argument("-k", "--top-k", type=number_in(int, 1), default=50, help="sample from the k most likely tokens")
    parser.add_argument("-m", "--max-tokens", type=number_in(int, 1), default=512, help="the most tokens a reply may have")
    parser.add_argument("--seed", type=int, default=None, help="sampling seed; None draws one")
    parser.add_argument("--device-type", type=str, default=None, choices=["cuda", "cpu", "mps"], help="None detects the device")
    args = parser.parse_args()

    from nanorl.common import compute_init, get_base_dir
    try:
        from nanorl.checkpoint import load_model
    except ImportError as e:
        sys.exit(f"chat_cli needs nanorl/checkpoint.py (load_model), which this checkout does not have yet ({e})")
    _, _, _, _, device = compute_init(args.device_type)
    try:
        model, tokenizer, _ = load_model(args.source, device, phase="eval", model_tag=args.model_tag, step=args.model_step, hf_model=args.hf_model)
    except (FileNotFoundError, ValueError) as e:
        sys.exit(f"could not load the {args.source} model: {e}")
    engine = Engine(model, tokenizer, batch_size=1)
    print0(engine.attention_kernels())
    base = args.source == "base"
    settings = dict(base=base, temperature=args.temperature, top_k=args.top_k, max_tokens=args.max_tokens, seed=args.seed)

    if args.prompt is not None:
        chat_turn(engine, tokenizer, {"messages": [{"role": "user", "content": args.prompt}]}, **settings)
        return
    line_editing(os.path.join(get_base_dir(), "chat_history"))
    # Ctrl-C clears the line even when we were started with SIGINT ignored (a shell's background job passes that on)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    print(f"nanorl chat ({args.source}). 'clear' starts a new conversation, 'quit' or Ctrl-D leaves, Ctrl-C clears the line.")
    conversation = {"messages": []}
    while True:
        try:
            user = input("\nUser: ").strip()
        except KeyboardInterrupt:  # Ctrl-C: drop what was typed, ask again
            print()
            continue
        except EOFError:  # Ctrl-D
            print()
            return
        if user in ("quit", "exit"):
            return
        if user == "clear":
            conversation = {"messages": []}
            continue
        if not user:
            continue
        conversation["messages"].append({"role": "user", "content": user})
        print("\nCompletion: " if base else "\nAssistant: ", end="", flush=True)
        try:
            reply = chat_turn(engine, tokenizer, conversation, **settings)
        except KeyboardInterrupt:
            print(" [interrupted]")
            conversation["messages"].pop()
            continue
        except ValueError as e:
            print(f"\n{e}")
            conversation["messages"].pop()
            continue
        # a base model has no turns: each prompt starts fresh
        conversation["messages"] = [] if base else conversation["messages"] + [reply]


if __name__ == "__main__":
    main()
