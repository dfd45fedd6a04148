"""
RL on agents written with the openai client. An agent is the user's function(client, item) -> float | {"total": ..}
(or an `async def` taking an openai.AsyncOpenAI): it runs one episode, talking to the model through the official
client over as many calls as it likes, and returns the episode's score. The client's requests never leave the
process: an httpx transport hands each one to this episode's Endpoint, which validates it with nanorl/openai_api.py,
samples it on the RL engine and records the exact prompt ids, sampled ids and log-probs of every call.

  Endpoint             one episode's /v1/chat/completions (and /v1/models) on the engine, and its record
  Transport            httpx transports into an Endpoint; client() builds the official client on one
  Chain                a Sample being built from the calls that continue one another
  AgentRollout         the rollout: each prompt's n episodes run in threads, a group of Samples per prompt; it has
                       the shape of a custom generate function (nanorl/rollout.py), so chat_rl's --agent is one line

How calls become Samples (docs/agents.md): a call whose messages are an earlier call's messages, then the reply that
call returned (text and tool calls, as returned), then more messages continues that call: its prompt is the earlier
call's recorded prompt + sampled ids (+ the end-of-turn token, forced, if the reply was cut) + the new messages'
ids. The recorded ids are used even when the re-rendered history tokenizes differently (retokenization drift), so
the trainer sees exactly the sequence the engine sampled from. One Sample holds the whole chain, its loss mask 1 on
sampled tokens only (0 on the messages in between and on the engine's own tool outputs). A call that continues no
chain (the agent rewrote the history, a second conversation, a second choice of n) starts a Sample of its own.
"""

import asyncio
import copy
import inspect
import json
import threading
import time
import traceback
import uuid
from dataclasses import dataclass, field

import httpx
import openai

from nanorl.engine import Completion, Request
from nanorl.function_calls import chat_choice, final_deltas, reply_message
from nanorl.openai_api import (
    BadRequest,
    Message,
    ServeConfig,
    chat_messages,
    conversation_message,
    error_body,
    prepare,
    stop_strings,
    tool_plan,
)
from nanorl.rewards import check_reward, set_rewards
from nanorl.rollout import COMPLETED, TRUNCATED, Sample
from nanorl.serving import SampleText, chat_logprobs, logprob_entries, sse, top_logprobs, usage

SEED_MASK = 2**62 - 1


class EpisodeClosed(RuntimeError):
    """The episode was closed (it ran past --agent-timeout, or the rollout ended): its client gets no more replies."""


@dataclass
class Turn:
    """One choice of one call: what a continuation must repeat, and what the engine was given and sampled."""

    messages: list  # the call's conversation messages (openai_api.chat_messages)
    tools: list | None  # the tools as the template rendered them
    reply: dict  # the reply as a conversation message, as the client will send it back
    tokens: list  # sampled ids, up to a stop string; the end-of-turn token included when the reply ended there


@dataclass
class Chain:
    """A Sample being built: its ids, and for every id after the first prompt its loss mask and rollout log-prob."""

    tokens: list
    prompt_len: int
    mask: list = field(default_factory=list)
    logprobs: list = field(default_factory=list)
    last: Turn | None = None
    calls: int = 0
    status: str = COMPLETED
    busy: bool = False  # a call continuing it is in flight: no other call may continue it too

    def add(self, between, tokens, mask, logprobs, turn, status):
        """Append ids the model did not write (mask 0), then a call's sampled ids."""
        self.tokens += between + tokens
        self.mask += [0] * len(between) + mask
        self.logprobs += [0.0] * len(between) + logprobs
        self.last, self.calls, self.status, self.busy = turn, self.calls + 1, status, False


@dataclass
class EpisodeSettings:
    """How an episode's calls are sampled: the rollout's own settings (the trainer computes log-probs at the same
    temperature), its response budget, and the episode's seed."""

    temperature: float
    top_k: int | None
    top_p: float | None
    max_response_len: int  # per Sample: every id after its first prompt counts (the messages in between too)
    seed: int


# --- one episode's endpoint -------------------------------------------------------------------------------------------


class Endpoint:
    """/v1/chat/completions for one episode, on the engine, recording every call into chains. Thread-safe; a call
    waits for its sample by stepping the engine itself (or, with a serve_forever thread, by waiting)."""

    def __init__(self, engine, tokenizer, settings):
        self.engine, self.tokenizer, self.settings = engine, tokenizer, settings
        self.config = ServeConfig(max_tokens=settings.max_response_len, model=None)  # any model name is this one
        self.eot = tokenizer.encode_special("<|assistant_end|>")
        self.chains, self.calls, self.handles, self.closed = [], 0, [], False
        self.lock = threading.Lock()

    def handle(self, method, path, raw):
        """An HTTP request -> (status, body text, content type). Every error is an OpenAI error object."""
        try:
            if method == "POST" and path.endswith("/chat/completions"):
                return self.chat(raw)
            if method == "GET" and path.endswith("/models"):
                card = {"id": "nanorl", "object": "model", "created": 0, "owned_by": "nanorl"}
                return 200, json.dumps({"object": "list", "data": [card]}), "application/json"
            raise BadRequest(f"not found: {method} {path} (the agents' endpoint serves chat completions)", status=404)
        except BadRequest as e:
            return e.status, json.dumps(error_body(e.message, param=e.param, code=e.code)), "application/json"
        except Exception as e:
            body = error_body(f"{type(e).__name__}: {e}", "server_error", code="internal_error")
            return 500, json.dumps(body), "application/json"

    def close(self):
        """No more replies; what is in flight is cancelled. Under the engine's step lock: once this returns, no thread
        of this episode steps the engine or submits to it again."""
        with self.engine.step_lock, self.lock:
            self.closed = True
            for h in self.handles:
                if not h.done:
                    h.cancel()

    def chat(self, raw):
        """One chat completion: validated and rendered as chat_web does it; its prompt is the recorded ids when it
        continues a chain; sampled with the rollout's settings, recorded, answered."""
        req, rendered, settings, _ = prepare(raw, self.tokenizer, self.config, self.engine.max_len)
        plan = tool_plan(req, self.tokenizer)
        self._check_sampling(req)
        messages = chat_messages(req)
        tools = [t.model_dump(exclude_none=True) for t in req.tools] if plan is not None and plan.parse else None
        with self.lock:
            chain, between = self._continues(messages, tools, rendered, plan is not None)
            prompt, used = rendered, 0
            if chain is not None:
                chain.busy = True
                prompt, used = chain.tokens + between, len(chain.tokens) - chain.prompt_len + len(between)
            seed, self.calls = hash((self.settings.seed, self.calls)) & SEED_MASK, self.calls + 1
        try:
            request = self._request(prompt, used, settings, seed)
            if request is None:  # the sample has no tokens left: an empty reply, cut as at max_tokens
                chain.status = TRUNCATED
                completions = [Completion([], [], [], TRUNCATED, len(prompt))] * settings["num_samples"]
            else:
                completions = self._sample(request)
            replies = [self._reply(c, stop_strings(req), plan) for c in completions]  # (message, finish, kept)
            with self.lock:
                for j, (c, (message, _, kept)) in enumerate(zip(completions, replies)):
                    if request is not None:
                        self._record(chain if j == 0 else None, between, prompt, c, kept, message, messages, tools)
        finally:
            if chain is not None:
                chain.busy = False
        return self._response(req, prompt, completions, replies)

    def _request(self, prompt, used, settings, seed):
        """The engine request of a call: the rollout's sampling, within what is left of its sample's budget (the
        sample's --max-new-tokens, the context); None when nothing is left."""
        s = self.settings
        room = min(s.max_response_len - used, self.engine.max_len - len(prompt))
        if room < 1:
            return None
        return Request(
            prompt,
            num_samples=settings["num_samples"],
            max_tokens=min(settings["max_tokens"], room),
            temperature=s.temperature,
            top_k=s.top_k,
            top_p=s.top_p,
            seed=seed,
            stop_tokens=settings["stop_tokens"],
        )

    def _check_sampling(self, req):
        """Sampling settings the rollout fixes: a call may repeat them, never change them."""
        s = self.settings
        if req.temperature is not None and req.temperature != s.temperature:
            raise BadRequest(
                f"'temperature' {req.temperature:g}: an episode samples at the rollout's temperature "
                f"{s.temperature:g} (the trainer computes its log-probs at it); leave temperature out",
                "temperature",
            )
        if req.top_k is not None and (None if req.top_k == -1 else req.top_k) != s.top_k:
            raise BadRequest(f"'top_k' {req.top_k}: an episode samples with the rollout's ({s.top_k})", "top_k")
        if req.top_p is not None and req.top_p != (s.top_p or 1.0):
            raise BadRequest(f"'top_p' {req.top_p:g}: an episode samples with the rollout's ({s.top_p})", "top_p")
        if req.seed is not None:
            raise BadRequest(
                "'seed': the rollout seeds every call of an episode itself (so that a group's episodes differ and "
                "a run replays); leave seed out",
                "seed",
            )

    def _continues(self, messages, tools, rendered, tool_path):
        """(the chain this call continues, the ids between its last reply and this call's reply: the forced end of
        turn if that reply was cut, then the new messages), or (None, None) when it continues none."""
        for chain in reversed(self.chains):
            last = chain.last
            k = len(last.messages)
            if chain.busy or last.tools != tools or len(messages) <= k + 1 or messages[:k] != last.messages:
                continue
            if messages[k] != last.reply:
                continue
            head = self._history(messages[: k + 1], tools, tool_path)
            if head is None or rendered[: len(head)] != head:  # the template renders the history differently now
                continue
            forced = [] if last.tokens and last.tokens[-1] == self.eot else [self.eot]
            return chain, forced + rendered[len(head) :]
        return None, None

    def _history(self, messages, tools, tool_path):
        """The re-rendered ids of a conversation that ends with an assistant reply, up to its end-of-turn token,
        rendered as the call's own prompt was (tool_path: openai_api.tool_prompt's way)."""
        try:
            if tool_path:
                ids = self.tokenizer.render_messages(messages, tools, add_generation_prompt=False)
            else:
                ids = self.tokenizer.render_conversation({"messages": messages})[0]
        except ValueError:
            return None
        ends = [i for i, t in enumerate(ids) if t == self.eot]
        return ids[: ends[-1] + 1] if ends else None

    def _sample(self, request):
        """Submit and wait, stepping the engine: no episode waits on another's thread."""
        with self.lock:
            if self.closed:
                raise EpisodeClosed("this episode was closed (it ran past --agent-timeout)")
            handle = self.engine.submit(request)
            self.handles.append(handle)
        while not handle.done:
            if self.engine.serving:
                handle.finished.wait(0.05)
                continue
            with self.engine.step_lock:
                if self.closed:
                    raise EpisodeClosed("this episode was closed (it ran past --agent-timeout)")
                self.engine.step()
        if self.closed:
            raise EpisodeClosed("this episode was closed (it ran past --agent-timeout)")
        bad = next((c for c in handle.completions if c.status not in (COMPLETED, TRUNCATED)), None)
        if bad is not None:
            raise RuntimeError(f"the engine ended this call {bad.status}: {handle.error}")
        return handle.completions

    def _reply(self, completion, stops, plan):
        """A completion -> (the assistant message, finish_reason, how many of its ids the reply keeps: up to a stop
        string). The message is made once: the response and the record hold the same tool call ids."""
        st, text = SampleText(self.tokenizer, stops, parts=False), ""
        for t in completion.tokens:
            text += "".join(piece for _, piece in st.push(t))
            if st.done:
                break
        if not st.done:
            text += "".join(piece for _, piece in st.end(completion.status))
        return reply_message(text, plan), st.finish_reason, st.count

    def _record(self, chain, between, prompt, completion, kept, message, messages, tools):
        """One choice into the chains: it extends the chain it continues, else starts one."""
        try:  # the reply as the client will send it back, normalised as the next call's messages will be
            reply = conversation_message(Message.model_validate(message))
        except Exception:  # a reply no client could send back (too long): nothing will continue it
            reply = None
        tokens = completion.tokens[:kept]
        turn = Turn(messages, tools, reply, tokens)
        status = TRUNCATED if completion.status == TRUNCATED and kept == len(completion.tokens) else COMPLETED
        args = (tokens, completion.mask[:kept], completion.logprobs[:kept], turn, status)
        if chain is None:
            chain = Chain(list(prompt), len(prompt))
            self.chains.append(chain)
            chain.add([], *args)
        else:
            chain.add(between, *args)

    def _response(self, req, prompt, completions, replies):
        """The OpenAI response body: a chat.completion, or its chunks as server-sent events."""
        head = {"id": f"chatcmpl-{uuid.uuid4().hex[:24]}", "created": int(time.time()), "model": req.model or "nanorl"}
        logprobs = [None] * len(completions)
        if req.logprobs:
            for j, (c, (_, _, kept)) in enumerate(zip(completions, replies)):
                n = kept - (c.status == COMPLETED and kept == len(c.tokens))  # the end-of-turn token is no part of it
                tops = top_logprobs(self.engine, prompt, c.tokens[:n], req.top_logprobs) if req.top_logprobs else None
                logprobs[j] = chat_logprobs(logprob_entries(self.tokenizer, c.tokens[:n], c.logprobs[:n], tops))
        tokens = usage(len(prompt), sum(kept for _, _, kept in replies))
        if not req.stream:
            choices = [chat_choice(j, msg, why, logprobs[j]) for j, (msg, why, _) in enumerate(replies)]
            body = {**head, "object": "chat.completion", "choices": choices, "usage": tokens}
            return 200, json.dumps(body), "application/json"
        with_usage = req.stream_options is not None and req.stream_options.include_usage
        head = {**head, "object": "chat.completion.chunk", **({"usage": None} if with_usage else {})}
        out = []
        for j, (message, why, _) in enumerate(replies):  # the whole reply is there: its content in one delta
            opening = {
                "index": j,
                "delta": {"role": "assistant", "content": ""},
                "logprobs": None,
                "finish_reason": None,
            }
            out += [opening, *final_deltas(j, message, why, logprobs[j])]
        events = [sse({**head, "choices": [choice]}) for choice in out]
        if with_usage:
            events.append(sse({**head, "choices": [], "usage": tokens}))
        return 200, "".join(events) + "data: [DONE]\n\n", "text/event-stream"


# --- the official client on an endpoint -------------------------------------------------------------------------------


class Transport(httpx.BaseTransport):
    """httpx's side of an Endpoint: the request is answered in this thread, no socket involved."""

    def __init__(self, endpoint):
        self.endpoint = endpoint

    def handle_request(self, request):
        status, body, kind = self.endpoint.handle(request.method, request.url.path, request.read())
        return httpx.Response(status, content=body.encode(), headers={"content-type": kind})


class AsyncTransport(httpx.AsyncBaseTransport):
    """The same for httpx.AsyncClient: the endpoint runs in a worker thread, so the event loop stays free."""

    def __init__(self, endpoint):
        self.endpoint = endpoint

    async def handle_async_request(self, request):
        raw = await request.aread()
        status, body, kind = await asyncio.to_thread(self.endpoint.handle, request.method, request.url.path, raw)
        return httpx.Response(status, content=body.encode(), headers={"content-type": kind})


def client(endpoint, asynchronous=False):
    """The official openai client (AsyncOpenAI if asynchronous) whose requests go to this endpoint. No retries: a
    retried call would sample again and be recorded twice."""
    if asynchronous:
        http = httpx.AsyncClient(transport=AsyncTransport(endpoint), base_url="http://nanorl.agent")
        return openai.AsyncOpenAI(base_url="http://nanorl.agent/v1", api_key="none", max_retries=0, http_client=http)
    http = httpx.Client(transport=Transport(endpoint), base_url="http://nanorl.agent")
    return openai.OpenAI(base_url="http://nanorl.agent/v1", api_key="none", max_retries=0, http_client=http)


# --- the rollout: episodes in threads, their chains as groups of Samples ----------------------------------------------


def agent_item(p):
    """A prompt item as the agent gets it (its own copy): the chat so far ("messages": the conversation without its
    answer, or the text as one user message), the label and the metadata, as the reward functions see them."""
    if "conversation" in p:
        messages = list(p["conversation"]["messages"])
        if messages and messages[-1]["role"] == "assistant":
            messages = messages[:-1]
    else:
        messages = [{"role": "user", "content": p["text"]}]
    return copy.deepcopy({"messages": messages, "label": p["label"], "metadata": p["metadata"]})


@dataclass
class Episode:
    """One episode: its endpoint, the prompt it answers, and how it ended."""

    endpoint: Endpoint
    prompt: dict
    seed: int
    index: int
    result: tuple | None = None  # (score, None) | (None, why it was lost)
    item: dict = field(init=False)

    def __post_init__(self):
        self.item = agent_item(self.prompt)


class AgentRollout:
    """--agent as a custom generate function: __call__(config, engine, tokenizer, prompts, seeds) -> groups. Each
    prompt's config.group.n_samples_per_prompt episodes form its group; an episode that raises, runs past `timeout`
    seconds (0: no limit), returns something other than a finite number (or a dict of them with a "total") or whose
    client got an error it did not catch is lost: one line names it, its samples keep their place in the group but
    are never trained on (loss mask 0, the group's mean reward: advantage 0), as a failed reward with --rm-failure
    drop. metrics() gives the rollout's agent counts."""

    def __init__(self, agent, timeout):
        self.agent, self.timeout = agent, timeout
        self.is_async = inspect.iscoroutinefunction(agent)

    def __call__(self, config, engine, tokenizer, prompts, seeds):
        spec = config.group  # the call's: the eval's n and temperature for the eval
        n = spec.n_samples_per_prompt
        episodes = []
        for p, seed in zip(prompts, seeds):
            for j in range(n):
                settings = EpisodeSettings(
                    spec.temperature,
                    config.top_k,
                    config.top_p,
                    spec.max_response_len,
                    hash((seed, j)) & SEED_MASK,
                )
                episodes.append(Episode(Endpoint(engine, tokenizer, settings), p, seed, j))
        self.run(episodes)
        filler = [tokenizer.encode_special("<|assistant_end|>")] * 2
        return [group(episodes[i * n : (i + 1) * n], filler) for i in range(len(prompts))]

    def run(self, episodes):
        """Every episode in its own thread, all at once (their calls share the engine's batch); wait up to the
        timeout, then close them all."""
        threads = [threading.Thread(target=self.episode, args=(e,), daemon=True) for e in episodes]
        start = time.monotonic()
        try:
            for t in threads:
                t.start()
            for t in threads:
                t.join(None if not self.timeout else max(0.0, start + self.timeout - time.monotonic()))
        finally:
            for e in episodes:
                e.endpoint.close()
        for e, t in zip(episodes, threads):
            if t.is_alive():
                e.result = (None, f"ran past --agent-timeout {self.timeout:g}s")
            elif e.result is None:
                e.result = (None, "ended without a result")
            if e.result[0] is None:
                md = e.item["metadata"]
                where = f"{md.get('task')} {md.get('split')} row {md.get('row')}, episode {e.index}"
                print(f"agent: lost an episode ({where}): {e.result[1]}", flush=True)

    def episode(self, e):
        """One episode, in its thread: e.result = (score, None) or (None, why it was lost)."""
        try:
            if self.is_async:
                value = asyncio.run(self.agent(client(e.endpoint, asynchronous=True), e.item))
            else:
                value = self.agent(client(e.endpoint), e.item)
        except (Exception, SystemExit) as ex:  # an agent calling exit() must not end training either
            e.result = (None, traceback.format_exception_only(ex)[-1].strip().replace("\n", " | "))  # one line
            return
        score, why = check_reward(value)
        e.result = (score, None) if why is None else (None, f"returned {why}")

    def metrics(self, samples):
        """rollout/agent_lost_frac: the fraction of episodes lost; rollout/agent_calls_mean: calls per episode."""
        episodes = {s.metadata["episode"]: s.metadata for s in samples if "episode" in s.metadata}
        lost = sum("agent_error" in md for md in episodes.values())
        calls = sum(md["calls"] for md in episodes.values())
        return {
            "rollout/agent_lost_frac": lost / max(len(episodes), 1),
            "rollout/agent_calls_mean": calls / max(len(episodes), 1),
        }


def group(episodes, filler):
    """One prompt's episodes -> its group of Samples. An episode of k chains gives k Samples; when the episodes give
    different numbers, the group is laid out in layers of one Sample per episode (layer i: each episode's i-th chain,
    or a `filler` Sample of two ids that is never trained on), so that every consecutive run of n Samples has the
    episodes' rewards and every estimator gives each Sample its episode's advantage."""
    samples = [[to_sample(e, c) for c in e.endpoint.chains] for e in episodes]
    depth = max(1, *(len(s) for s in samples))
    out, results = [], []
    for layer in range(depth):
        for e, own in zip(episodes, samples):
            if layer < len(own):
                out.append(own[layer])
            else:
                out.append(to_sample(e, Chain(list(filler), 1, [0], [0.0])))
                out[-1].metadata["filler"] = True
            results.append(e.result)
    set_rewards([out], out, results, "drop")
    return out


def to_sample(e, chain):
    md = {**e.prompt["metadata"], "seed": e.seed, "episode": f"{e.seed}:{e.index}", "calls": e.endpoint.calls}
    if e.result[0] is None:
        md["agent_error"] = e.result[1]
    return Sample(
        prompt=e.prompt.get("conversation", e.prompt.get("text")),
        tokens=list(chain.tokens),
        response_length=len(chain.tokens) - chain.prompt_len,
        label=e.prompt["label"],
        loss_mask=list(chain.mask),
        rollout_log_probs=list(chain.logprobs),
        status=chain.status,
        index=e.index,
        metadata=md,
    )
