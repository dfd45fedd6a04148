"""
An agent for `chat_rl --agent`: it asks the question, checks the answer after `####` against the label, and when it
is wrong says "wrong, try again" once; the episode scores 1 if the final answer is right, else 0. Written against the
official openai client, as it would be against any OpenAI-compatible server.

    python -m scripts.chat_rl --agent examples/retry_agent.py:agent --levels 1,2 --max-new-tokens 256
    python -m scripts.chat_rl --agent examples/retry_agent.py:async_agent ...   # the same with openai.AsyncOpenAI

`item` is the prompt row: item["messages"] (the chat so far: here the problem as one user message), item["label"]
(the answer) and item["metadata"]. Both calls continue one conversation, so each episode trains as one sample: the
two replies are trained on, the user's "wrong, try again" between them is not (docs/agents.md).
"""

from nanorl.rewards import math_reward

RETRY = "wrong, try again"


def agent(client, item):
    messages = list(item["messages"])
    reply = client.chat.completions.create(model="nanorl", messages=messages).choices[0].message.content
    if math_reward(reply, item["label"]) == 1.0:
        return 1.0
    messages += [{"role": "assistant", "content": reply}, {"role": "user", "content": RETRY}]
    reply = client.chat.completions.create(model="nanorl", messages=messages).choices[0].message.content
    return math_reward(reply, item["label"])


async def async_agent(client, item):
    messages = list(item["messages"])
    reply = (await client.chat.completions.create(model="nanorl", messages=messages)).choices[0].message.content
    if math_reward(reply, item["label"]) == 1.0:
        return 1.0
    messages += [{"role": "assistant", "content": reply}, {"role": "user", "content": RETRY}]
    reply = (await client.chat.completions.create(model="nanorl", messages=messages)).choices[0].message.content
    return math_reward(reply, item["label"])
