"""An agent for chat_rl --agent tests on random-weight models: two turns, scored by the fraction of vowels in the
last reply, so that rewards differ within a group and advantages are not all zero."""


def vowel_agent(client, item):
    messages = list(item["messages"])
    reply = client.chat.completions.create(model="nanorl", messages=messages, max_tokens=12).choices[0].message
    messages += [reply, {"role": "user", "content": "wrong, try again"}]
    text = client.chat.completions.create(model="nanorl", messages=messages, max_tokens=12).choices[0].message.content
    return sum(c in "aeiou" for c in text) / max(len(text), 1)
