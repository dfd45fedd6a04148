"""README's claims that can be checked without the tiny run's model: its examples are held-out problems graded as it
says, the accuracy beside them is its card's, and the quick start's time is the one its Results measured."""

import re
from pathlib import Path

from nanorl.synthetic import letter_count_split
from tasks import get_task
from tasks.offline import OfflineProblems

README = (Path(__file__).resolve().parents[1] / "README.md").read_text()


def card_row(metric):
    row = next(line for line in README.splitlines() if line.startswith(f"| {metric} |"))
    return [c.strip() for c in row.strip("|").split("|")][1:]


def test_examples_are_held_out_graded_as_shown_beside_the_cards_accuracy():
    """Each example question is a held-out offline problem of the level it states (the test split the card evaluates,
    in none of the training sets mid_train and chat_rl draw), and "right" or "wrong" is its answer against the
    problem's own; the accuracies quoted are the card's RL greedy rows; the chat_cli command asks one of them."""
    table = README.split("| held-out question | level | the tiny run's answer |")[1].split("\n\n")[0]
    rows = re.findall(r"^\| (.+?) \| (\d) \| (.+) \|$", table, re.M)
    labels = {}  # the card's two draws of held-out problems: question -> (label, level)
    for levels in ((1, 2), (3, 4)):
        test = get_task("offline", "test", levels=levels)
        labels.update({p["question"]: (p["label"], str(p["level"])) for p in test.problems})
    train = {
        t.get_example(i)["messages"][0]["content"]
        for t in (OfflineProblems("train"), OfflineProblems("train", seed=1))
        for i in range(len(t))
    }
    verdicts = []
    for question, level, answer in rows:
        assert question in labels and labels[question][1] == level and question not in train, question
        count = re.search(r"letter (\w) appear in the word (\w+)", question)
        if count:  # a letter count held out is taught by no stage (SpellingBee, pretraining's spelling facts)
            assert letter_count_split(count.group(2), count.group(1)) == "test", question
        said = re.search(r"`#### (\d+)`: (right|wrong)", answer)
        assert said and (said.group(1) == labels[question][0]) == (said.group(2) == "right"), (question, answer)
        verdicts.append(said.group(2))
    assert len(rows) == 3 and verdicts.count("wrong") == 1
    easy, hard = re.search(r"It answers ([\d.]+)% of\s+the held-out level 1,2 ones and ([\d.]+)% of", README).groups()
    assert f"{float(easy) / 100:.4f}" == card_row("offline levels 1,2 accuracy (greedy, 200 problems)")[3]  # RL
    assert f"{float(hard) / 100:.4f}" == card_row("offline levels 3,4 accuracy (greedy, 200 problems)")[3]
    asked = re.search(r'chat_cli -i rl -t 0 -p "(.+?)"', README).group(1)
    assert asked in [q for q, _, _ in rows]


def test_the_quick_starts_time_is_the_measured_one():
    """The quick start's minutes are the Results' measured wall time (installs included), rounded."""
    said = int(re.search(r"about (\d+) minutes on 2 cores", README).group(1))
    wall, stages, setup = map(
        float, re.search(r"([\d.]+) min wall, ([\d.]+) of them in the stages, ([\d.]+) in setup", README).groups()
    )
    assert said == round(wall) and abs(stages + setup - wall) < 0.11
