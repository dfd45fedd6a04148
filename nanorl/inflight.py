"""
The engine's per-sample state on the host: one InflightSample per sample of a request, waiting for a slot or occupying one,
and SlotRecords, the host arrays of what each slot's sample has generated so far (so a decode step checks every row
for stops, limits and tool calls with a few array ops). nanorl/engine.py's scheduler keeps them.
"""

import collections

import numpy as np

from nanorl.sampling import uniform_from_counter


class InflightSample:
    """One sample of a request, waiting for a slot or occupying one."""

    def __init__(self, handle, index, seed):
        self.handle, self.index, self.row_seed = handle, index, seed
        self.out = handle.completions[index]
        self.slot = None
        self.forced = collections.deque()  # tool output tokens waiting to be fed in


class SlotRecords:
    """Per slot: the sample's generated tokens with their log-probs and masks, its token budget, and the tokens
    that need the host when sampled ("watched": its stop tokens, and <|python_end|> when it uses tools). A decode
    step appends to every row and finds the rows that need the host with a handful of array ops (append); rows
    move with their samples (move) and are read back into a Completion when the sample ends (lists)."""

    def __init__(self, batch_size, max_len):
        B, self.max_len = batch_size, max_len
        self.n_gen, self.prompt_len, self.limit = (np.zeros(B, dtype=np.int64) for _ in range(3))
        # which prefill wrote the slot's prompt KV (Engine._prefill numbers them): slots with one number hold the
        # same prompt KV, bit for bit (prefix sharing), which lets a decode step read it once (gpt.LockstepDecode)
        self.prefill = np.zeros(B, dtype=np.int64)
        # the sample's random stream: its row seed and how many tokens it has drawn (nanorl/sampling.py)
        self.seed, self.counter = np.zeros(B, dtype=np.int64), np.zeros(B, dtype=np.int64)
        self.watch = np.full((B, 3), -1, dtype=np.int64)  # padded with -1; widened for a request with more stops
        self.streamed, self.filtered, self.greedy, self.unit = (np.zeros(B, dtype=bool) for _ in range(4))
        self.out = np.zeros((B, max_len, 2), dtype=np.float64)  # (token, log-prob): one write per step
        self.mask = np.ones((B, max_len), dtype=np.int8)  # 0 where a token was forced in

    def fill(self, sample, python_end):
        """The sample starts in its slot."""
        slot, handle = sample.slot, sample.handle
        r = handle.request
        watch = sorted(t for t in handle.stops | ({python_end} if r.use_tools else set()) if t is not None)
        if len(watch) > self.watch.shape[1]:
            wider = np.full((self.watch.shape[0], len(watch)), -1, dtype=np.int64)
            wider[:, : self.watch.shape[1]] = self.watch
            self.watch = wider
        self.n_gen[slot], self.prompt_len[slot] = 0, len(r.prompt_ids)
        self.seed[slot], self.counter[slot] = sample.row_seed, r.start_counter
        self.limit[slot] = min(r.max_tokens, self.max_len - len(r.prompt_ids))  # its budget, and the context
        self.watch[slot] = -1
        self.watch[slot, : len(watch)] = watch
        self.mask[slot] = 1
        self.streamed[slot], self.filtered[slot] = handle.events is not None, handle.filtered
        self.greedy[slot], self.unit[slot] = r.temperature == 0, r.temperature in (0, 1)  # unit: no division

    def move(self, src, dst):
        for a in vars(self).values():  # every per-slot array above
            if isinstance(a, np.ndarray):
                a[dst] = a[src]

    def uniforms(self, slots):
        """The uniform each sample of slots (an index array) draws its next token with."""
        return uniform_from_counter(self.seed[slots], self.counter[slots])

    def lengths(self, n):
        """Prompt + generated tokens of slots 0..n-1."""
        return self.prompt_len[:n] + self.n_gen[:n]

    def append(self, slots, tokens, logprobs, forced=None):
        """Append one token to each of slots (an index array): tokens and logprobs (m,) numpy, forced = (m,) forced
        tokens or -1 (None: none forced). -> bool (m,): the slots that need the host (a watched token sampled, the
        budget or context used up, or streamed). Forced tokens are never watched."""
        k = self.n_gen[slots]
        self.out[slots, k, 0] = tokens
        self.out[slots, k, 1] = logprobs
        self.n_gen[slots] += 1
        self.counter[slots] += 1  # every token, forced ones too (a continuation's start_counter is its response length)
        hit = (self.watch[slots] == tokens[:, None]).any(1)
        if forced is not None:
            sampled = forced < 0
            self.mask[slots, k] = sampled
            hit &= sampled
        return hit | (k + 1 >= self.limit[slots]) | self.streamed[slots]

    def full(self, slot):
        return self.n_gen[slot] >= self.limit[slot]

    def generated(self, slot):
        return self.out[slot, : self.n_gen[slot], 0].astype(np.int64).tolist()

    def lists(self, slot):
        """(tokens, logprobs, mask) of slot's sample as Python lists, as a Completion holds them."""
        k = self.n_gen[slot]
        out = self.out[slot, :k]
        return out[:, 0].astype(np.int64).tolist(), out[:, 1].tolist(), self.mask[slot, :k].tolist()
