"""A reward for RL tests on random-weight models: the fraction of vowels in the response, so rewards
differ within a group and advantages are not all zero."""


def vowel_reward(response, label, metadata):
    return sum(c in "aeiou" for c in response) / max(len(response), 1)


def broken_reward(response, label, metadata):
    if len(response) % 2:
        raise RuntimeError("flaky reward server")
    return float("nan") if len(response) % 3 == 0 else 1.0
