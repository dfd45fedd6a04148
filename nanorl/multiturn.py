"""
Multi-turn tool use for RL rollouts. The model writes until it closes a tool call with <|python_end|>; the
call is run (the calculator, or the python sandbox), its result goes back in as
<|output_start|>result<|output_end|>, and the model carries on, for up to max_turns tool calls per response.

The engine can run the calculator by itself (Request.use_tools). Driving the turns here instead makes each
one explicit (calls are found, run and forced in by the same nanorl/toolcalls.py code the engine uses): any tool can answer, a turn limit can end a response, and every response carries its own
counts (tool calls, tool errors, turn limit hit) for the step's metrics. A request's first turn is one
engine request whose samples share the prompt's prefill, exactly as in engine.submit_and_wait, so a response
that never calls a tool is the very response engine.submit_and_wait samples; each later turn re-prefills
prompt + response so far (prefill is cheap next to decode) and joins the same continuous batch.

Tool output tokens get loss mask 0 and rollout log-prob 0: the model did not write them, so they are
neither trained on nor part of any importance ratio. Model tokens keep the engine's log-probs: log_softmax(logits / T)
at the request's temperature, in every turn, which is what the trainer computes at the rollout temperature.
"""

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace

from nanorl.engine import Completion
from nanorl.execution import execute_code
from nanorl.toolcalls import calculator, run_tool

TOOLS = ("calculator", "python")


def python_tool(code, timeout=5.0):
    """Run code in the sandbox: what it printed, or 'Error: ...' (the model sees either as the tool's output)."""
    r = execute_code(code, timeout=timeout)
    return r.stdout.strip() if r.success else f"Error: {r.error}"


def make_tool(name, timeout=5.0):
    """'calculator' | 'python' -> fn(source) -> output string. Never raises or hangs: errors are 'Error: ...'."""
    if name == "calculator":
        return lambda src: run_tool(src, calculator, timeout)
    if name == "python":  # the sandbox enforces its own timeout; the slack covers the interpreter's start
        return lambda src: run_tool(src, lambda code: python_tool(code, timeout), timeout + 5)
    raise ValueError(f"unknown tool {name!r}; valid: {', '.join(TOOLS)}")


@dataclass
class TurnCompletion(Completion):
    """A Completion built over several turns, with its tool-use counts."""

    tool_calls: int = 0
    tool_errors: int = 0  # calls whose output was an error
    max_turns_hit: bool = False  # it tried one tool call more than max_turns allows

    def turn_stats(self):
        return {"tool_calls": self.tool_calls, "tool_errors": self.tool_errors, "max_turns_hit": self.max_turns_hit}


def multi_turn_generate(engine, requests, max_turns, tool, tool_workers=16):
    """
    engine.submit_and_wait(requests), with tool calls run between turns: for each request, its list of
    num_samples TurnCompletions. A response ends "completed" at a stop token, "truncated" at its
    max_tokens or the engine's context (a tool output that does not fit is cut), or "truncated" with
    max_turns_hit when it closes one tool call more than max_turns (that call is not run).
    """
    if max_turns < 1:
        raise ValueError(f"max_turns must be >= 1, got {max_turns}")
    out = [[TurnCompletion([], [], [], "running", len(r.prompt_ids)) for _ in range(r.num_samples)] for r in requests]
    live = {}  # engine handle -> [(request, the response it continues, sample index)]
    firsts = [replace(r, stop_tokens=_stops(engine, r), use_tools=False) for r in requests]
    for i, h in enumerate(engine.submit_all(firsts)):  # all validated before any is queued
        live[h] = [(requests[i], c, j) for j, c in enumerate(out[i])]
    # the calls of turns that end in the same step run at once: the python sandbox takes ~50 ms a call
    with ThreadPoolExecutor(max_workers=tool_workers) as pool:
        while live:
            engine.step()
            ended = [
                (owner, turn) for h in [h for h in live if h.done] for owner, turn in zip(live.pop(h), h.completions)
            ]
            calls = [(owner, _add_turn(engine, max_turns, owner[1], turn)) for owner, turn in ended]
            outputs = iter(pool.map(tool, [src for _, src in calls if isinstance(src, str)]))
            for (r, c, j), src in calls:
                if src is _ENDED:
                    continue
                if isinstance(src, str):
                    _add_output(engine, r, c, next(outputs))
                nxt = _next_turn(engine, r, c, j)
                if nxt is not None:
                    live[engine.submit(nxt)] = [(r, c, j)]
    return out


_ENDED, _GO_ON = object(), object()


def _stops(engine, r):
    stops = engine.default_stops if r.stop_tokens is None else r.stop_tokens
    return sorted(set(stops) | {engine.markup.python_end})


def _add_turn(engine, max_turns, c, turn):
    """Add one turn to response c: the source of the tool call it closed, _GO_ON, or _ENDED when c is done."""
    c.tokens += turn.tokens
    c.logprobs += turn.logprobs
    c.mask += turn.mask
    c.status = turn.status
    if turn.status != "completed" or turn.tokens[-1] != engine.markup.python_end:
        return _ENDED  # <|assistant_end|> (or another stop token), out of tokens or context, aborted
    source = engine.markup.open_call(c.tokens)
    if source is None:
        return _GO_ON  # a <|python_end|> that closes no call is just a token: the model goes on
    if c.tool_calls == max_turns:
        c.max_turns_hit, c.status = True, "truncated"
        return _ENDED
    return source


def _add_output(engine, r, c, result):
    """Force the tool's result in: not the model's tokens, so loss mask 0 and rollout log-prob 0."""
    c.tool_calls += 1
    c.tool_errors += result.startswith("Error")
    forced = engine.markup.output_tokens(result)[: _room(engine, r, c)]
    c.tokens += forced
    c.logprobs += [0.0] * len(forced)
    c.mask += [0] * len(forced)


def _next_turn(engine, r, c, j):
    """The Request that continues response c (sample j of request r), or None when it has no room left."""
    room = _room(engine, r, c)
    if room < 1:
        c.status = "truncated"
        return None
    seed = None if r.seed is None else hash((r.seed, j, len(c.tokens)))  # a fresh stream for every turn
    return replace(
        r,
        prompt_ids=list(r.prompt_ids) + c.tokens,
        num_samples=1,
        max_tokens=room,
        seed=seed,
        stop_tokens=_stops(engine, r),
        use_tools=False,
    )


def _room(engine, r, c):
    """Tokens response c may still grow by: its own budget, and the engine's context."""
    return min(r.max_tokens - len(c.tokens), engine.max_len - c.prompt_len - len(c.tokens))
