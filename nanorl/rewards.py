"""
The reward hub: turns (response text, label, metadata) into a number for RL. chat_rl asks for one function:

    reward_fn, name = make_reward(rm_type, task=train_task, custom_path=None, examples=None)
    value = reward_fn(response, label, {"row": i})     # a float, or a dict of components with a "total"

rm_type picks the grader; `name` says which, for the logs and the report card:
  task    (the default) the task's own grader, Task.reward: exactly the verdict chat_eval reports for it, against
          the task's example of the prompt's row (`examples`: the task's examples as the caller loaded them)
  math | boxed | mc | exact | f1 | format    a generic grader that replaces the task's, explicitly
  a weighted mix such as "math+format:0.9,0.1" or "task+format:0.9,0.1": a dict of components + "total"
  custom  a function fn(response, label, metadata) -> float | dict with a "total", from custom_path
          ("module:function" or "path/to/file.py:function")
A remote reward is an HTTP endpoint, scored in batches (nanorl/remote_rewards.py).

Every grader returns a number and looks at nothing but its arguments. safe_reward and remote_rewards never
raise: a broken reward becomes (None, reason), which set_rewards counts and drops, because one bad sample
must not kill a long run. The reward flags and the RewardConfig they make are nanorl/rl_config.py's.
"""

import math
import numbers
import re
import string
from collections import Counter

from nanorl.flags import load_function

# -----------------------------------------------------------------------------------------------
# extracting the final answer

# a number as written in text: optional sign, thousands groups or plain digits, decimals, an optional /b
_TEXT_NUMBER = re.compile(r"(?<![\d.)])-?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?:/\d+(?:\.\d+)?)?")


def _last_boxed(text):
    """Content of the last \\boxed{...}, nested braces included (unclosed: up to the end)."""
    i = text.rfind("\\boxed{")
    if i < 0:
        return None
    start = i + len("\\boxed{")
    depth = 1
    for k in range(start, len(text)):
        if text[k] == "{":
            depth += 1
        elif text[k] == "}":
            depth -= 1
            if depth == 0:
                return text[start:k]
    return text[start:]


def _after_hashes(text):
    """The first line after the last ####, or None when there is no #### or nothing follows it."""
    if "####" not in text:
        return None
    tail = text.rsplit("####", 1)[1].strip()
    return tail.split("\n")[0].strip() or None


def extract_answer(text):
    """The final answer of a response: after the last ####, else the last \\boxed{...}, else the last number."""
    if text is None:
        return None
    text = str(text)
    answer = _after_hashes(text)
    if answer is None:
        answer = _last_boxed(text)
    if answer is None:
        nums = _TEXT_NUMBER.findall(text)
        answer = nums[-1] if nums else None
    return answer.strip() if answer is not None else None


# -----------------------------------------------------------------------------------------------
# numbers

_FRAC = re.compile(r"\\[dt]?frac\s*\{([^{}]*)\}\s*\{([^{}]*)\}")  # \frac{a}{b}, \dfrac, \tfrac
_FRAC_SHORT = re.compile(r"\\[dt]?frac\s*(\d)(\d)")  # \frac12
_THOUSANDS = re.compile(r"(?<=\d),(?=\d{3}(?!\d))")
# sign, mantissa, optional "/ denominator": the *first* number of the cleaned string ("12 apples" -> 12)
_NUMBER = re.compile(r"([+-]?)\s*(\d+(?:\.\d*)?|\.\d+)(?:\s*/\s*([+-]?)\s*(\d+(?:\.\d*)?|\.\d+))?")


def normalize_number(s):
    """'1,234' '-5' '3.50' '3/4' '\\frac{3}{4}' '45%' '$12' '12 apples.' 'x = 7' -> a float, or None.
    A percent sign is dropped ('45%' -> 45.0); math_reward also accepts 0.45 for it."""
    if s is None or isinstance(s, bool):
        return None
    if isinstance(s, numbers.Real):
        return float(s) if math.isfinite(s) else None
    s = str(s).strip()
    boxed = _last_boxed(s)
    if boxed is not None:
        s = boxed
    s = _FRAC.sub(r"\1/\2", s)
    s = _FRAC_SHORT.sub(r"\1/\2", s)
    for junk in ("{,}", "\\,", "\\!", "\\ ", "\\$", "\\%", "$", "€", "£", "¥", "₹"):
        s = s.replace(junk, "")
    s = s.replace("−", "-")  # unicode minus
    if "=" in s:
        s = s.rsplit("=", 1)[1]  # "x = 7": the right-hand side
    s = _THOUSANDS.sub("", s)
    m = _NUMBER.search(s)
    if not m:
        return None
    sign, num, den_sign, den = m.groups()
    value = float(sign + num)
    if den is not None:
        d = float(den_sign + den)
        if d == 0:
            return None
        value /= d
    return value if math.isfinite(value) else None


def _numbers_equal(a, b):
    # whole numbers compare exactly: a relative tolerance would call 109200001 equal to 109200000
    # (GSM8K has answers that big); anything else within 1e-6 relative, so 0.333333 matches 1/3
    if a.is_integer() and b.is_integer():
        return a == b
    return math.isclose(a, b, rel_tol=1e-6, abs_tol=1e-9)


def _label_number(label):
    """A label is a bare answer ('1,000', '3/4', 7) or a full worked solution ending in '#### N' / \\boxed{}."""
    if isinstance(label, str) and ("####" in label or "\\boxed" in label):
        label = extract_answer(label)
    return normalize_number(label)


# -----------------------------------------------------------------------------------------------
# graders: (response, label) -> float


def math_reward(response, label):
    """1.0 when the response's final answer equals the label as a number, else 0.0."""
    answer = extract_answer(response)
    got, want = normalize_number(answer), _label_number(label)
    if got is None or want is None:
        return 0.0
    if _numbers_equal(got, want):
        return 1.0
    # "45%" for a label of 0.45 is right too (for a label of 45 the line above already said so)
    return 1.0 if "%" in answer and _numbers_equal(got / 100, want) else 0.0


def boxed_reward(response, label):
    """1.0 when the last \\boxed{...} of the response equals the label's (or the bare label): as numbers when
    both are numbers, else as text with spaces ignored. No \\boxed{}, no credit (unlike math, which falls
    back to #### and the last number)."""
    got = _last_boxed("" if response is None else str(response))
    if got is None or label is None:
        return 0.0
    want = _last_boxed(str(label))
    want = str(label) if want is None else want
    a, b = normalize_number(got), normalize_number(want)
    if a is not None and b is not None:
        return 1.0 if _numbers_equal(a, b) else 0.0
    return 1.0 if "".join(got.split()) == "".join(want.split()) and got.strip() else 0.0


_MC_ANSWER_IS = re.compile(r"(?i:answer)(?:\s+(?i:is))?\s*:?\s*(?:(?i:option|choice)\s*)?[(\[]?([A-J])\b")
_MC_ALONE = re.compile(r"^\s*[(\[]?([A-J])[)\]]?[.:]?\s*$")  # "B", "(B)", "B."
_MC_LEADING = re.compile(r"^\s*[(\[]?([A-J])[)\].:](?:\s|$)")  # "B) because...", "(C) ..."
_MC_PAREN = re.compile(r"[(\[]([A-J])[)\]]")
_MC_WORD = re.compile(r"\b([B-J]|A(?! [a-z]))\b")  # a standalone capital, but not the article in "A cat"


def extract_choice(text):
    """The multiple-choice letter (A-J) a response picks, or None. Explicit forms win over loose ones."""
    if text is None:
        return None
    text = str(text)
    m = _MC_ANSWER_IS.findall(text)
    if m:
        return m[-1]
    final = _after_hashes(text) or _last_boxed(text)
    for candidate in ([final] if final else []) + [text]:
        m = _MC_ALONE.match(candidate) or _MC_LEADING.match(candidate)
        if m:
            return m.group(1)
    for pattern in (_MC_PAREN, _MC_WORD):
        m = pattern.findall(text)
        if m:
            return m[-1]
    return None


def mc_reward(response, label):
    """Multiple choice: 1.0 when the letter the response picks ('B', '(B)', 'Answer: B', 'the answer is B.')
    is the label's letter."""
    got, want = extract_choice(response), extract_choice(str(label).strip().upper())
    return 1.0 if got is not None and got == want else 0.0


def _normalize_text(s):
    """SQuAD's answer normalisation: lowercase, no punctuation, no articles, single spaces."""
    s = str(s).lower()
    s = "".join(ch for ch in s if ch not in string.punctuation)
    s = re.sub(r"\b(a|an|the)\b", " ", s)
    return " ".join(s.split())


def _final_text(response):
    """What exact/f1 compare: the #### or \\boxed{} answer when there is one, else the whole response."""
    response = "" if response is None else str(response)
    final = _after_hashes(response)
    if final is None:
        final = _last_boxed(response)
    return response if final is None else final


def exact_match(response, label):
    """1.0 when the normalised final answer equals the normalised label (or any of a list of labels)."""
    labels = label if isinstance(label, (list, tuple)) else [label]
    got = _normalize_text(_final_text(response))
    return 1.0 if any(got == _normalize_text(l) for l in labels) else 0.0


def _f1(pred, gold):
    pred, gold = _normalize_text(pred).split(), _normalize_text(gold).split()
    if not pred or not gold:
        return float(pred == gold)
    common = sum((Counter(pred) & Counter(gold)).values())
    if common == 0:
        return 0.0
    p, r = common / len(pred), common / len(gold)
    return 2 * p * r / (p + r)


def f1_reward(response, label):
    """SQuAD token F1 between the final answer and the label (the best over a list of labels)."""
    labels = label if isinstance(label, (list, tuple)) else [label]
    got = _final_text(response)
    return max(_f1(got, l) for l in labels) if labels else 0.0


_FORMAT = re.compile(r"(?:^|\n)[ \t]*####[ \t]*-?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?\s*$")


def format_reward(response, label=None):
    """1.0 when the response ends with a well-formed '#### N' line (N a plain number), else 0.0."""
    return 1.0 if response is not None and _FORMAT.search(str(response)) else 0.0


GRADERS = {
    "math": math_reward,
    "boxed": boxed_reward,
    "mc": mc_reward,
    "exact": exact_match,
    "f1": f1_reward,
    "format": format_reward,
}
RM_TYPES = ["task", *GRADERS, "custom", "remote"]


def parse_rm_type(rm_type):
    """'math' -> [('math', 1.0)]; 'math+format:0.9,0.1' -> [('math', 0.9), ('format', 0.1)];
    'math+format' weighs every component 1.0. 'task' may be a component too."""
    names, _, weights = str(rm_type).partition(":")
    names = [n.strip() for n in names.split("+")]
    bad = [n for n in names if n not in GRADERS and n != "task"]
    if bad:
        raise ValueError(
            f"unknown rm_type component(s) {bad} in {rm_type!r}; valid: {', '.join(RM_TYPES)} "
            f"(or a weighted mix like math+format:0.9,0.1)"
        )
    try:
        w = [float(x) for x in weights.split(",")] if weights else [1.0] * len(names)
    except ValueError:
        raise ValueError(f"rm_type {rm_type!r}: weights must be numbers, like math+format:0.9,0.1") from None
    if len(w) != len(names):
        raise ValueError(f"rm_type {rm_type!r}: {len(names)} components but {len(w)} weights")
    return list(zip(names, w))


def task_reward(task, examples=None):
    """The task's own grader as a reward fn(response, label, metadata): metadata["row"] is the example's index
    in `task` (the same split and slice the prompt came from), and Task.reward grades against that example.
    examples: the task's examples by row as the caller loaded them (chat_rl's prompts hold them), so that grading
    rebuilds none; None: read from the task here, once."""
    if examples is None:
        examples = [task.get_example(i) for i in range(len(task))]

    def reward(response, label, metadata):
        row = (metadata or {}).get("row")
        if row is None:
            raise ValueError("--rm-type task needs metadata['row'], the prompt's index in its task")
        conversation = examples[row]
        want = conversation.get("label")
        if label is not None and want is not None and str(label) != str(want):  # graded against another task/split
            raise ValueError(
                f"{type(task).__name__} row {row} has label {want!r}, the sample has {label!r}: "
                f"this reward was made for another task or split"
            )
        return task.reward(conversation, "" if response is None else str(response))

    return reward


def _ignoring_metadata(grader):
    return lambda response, label, metadata=None: grader(response, label)


def make_reward(rm_type="task", task=None, custom_path=None, examples=None):
    """-> (fn(response, label, metadata) -> float | dict with a "total", name of the grader). Raises ValueError
    naming the flags for a combination that cannot work, before any training starts. examples: the task's examples
    by row, as task_reward takes them."""
    rm_type = str(rm_type)
    if custom_path is not None or rm_type == "custom":
        if rm_type not in ("task", "custom"):
            raise ValueError(f"--custom-rm-path and --rm-type {rm_type} both pick the reward: give one of them")
        if custom_path is None:
            raise ValueError("--rm-type custom needs --custom-rm-path module:function (or path/to/file.py:function)")
        fn = load_function(custom_path, ["response", "label", "metadata"], "--custom-rm-path")
        return fn, f"custom:{custom_path}"
    if rm_type == "remote":
        raise ValueError("--rm-type remote is scored in batches over HTTP: call remote_rewards(url, payloads)")
    parts = parse_rm_type(rm_type)
    if any(name == "task" for name, _ in parts):
        if task is None:
            raise ValueError(
                f"--rm-type {rm_type} grades with the task's own grader, but there is no task (prompts from a "
                f"file have none): pick --rm-type {' | '.join(GRADERS)} or --custom-rm-path"
            )
        if not task.has_grader:
            raise ValueError(
                f"{type(task).__name__} has no grader (it is chat data): pick --rm-type "
                f"{' | '.join(GRADERS)} or --custom-rm-path"
            )
    fns = {
        name: task_reward(task, examples) if name == "task" else _ignoring_metadata(GRADERS[name]) for name, _ in parts
    }
    names = [f"task:{type(task).__name__}" if n == "task" else n for n, _ in parts]
    if len(parts) == 1 and "+" not in rm_type and ":" not in rm_type:
        return fns[parts[0][0]], names[0]

    def mix(response, label, metadata=None):
        out = {name: fns[name](response, label, metadata) for name, _ in parts}
        out["total"] = sum(out[name] * w for name, w in parts)
        return out

    return mix, "+".join(names) + ":" + ",".join(f"{w:g}" for _, w in parts)


# -----------------------------------------------------------------------------------------------
# checking what a reward function gave back


def _finite_float(v):
    """v as a float if it is a finite number, else None."""
    if isinstance(v, (str, bytes)) or not isinstance(v, numbers.Real) and not hasattr(v, "__float__"):
        return None  # bools and numpy/torch scalars are fine, strings are not
    try:
        f = float(v)
    except Exception:  # a multi-element tensor, a complex, ...
        return None
    return f if math.isfinite(f) else None


def check_reward(value):
    """(float or dict of floats, None) for a finite number or a dict of them with a 'total'; else (None, why)."""
    if isinstance(value, dict):
        if "total" not in value:
            return None, f"a dict reward needs a 'total' key, got keys {sorted(map(str, value))}"
        out = {}
        for k, v in value.items():
            out[k] = _finite_float(v)
            if out[k] is None:
                return None, f"reward component {k!r} is not a finite number: {v!r:.80}"
        return out, None
    f = _finite_float(value)
    return (f, None) if f is not None else (None, f"reward is not a finite number: {value!r:.80}")


def safe_reward(fn, *args):
    """Call a reward function: (value, None) when it gives a finite number (or a dict of them with a
    'total'), else (None, reason). Never raises."""
    try:
        value = fn(*args)
    except (Exception, SystemExit) as e:  # a reward calling exit() must not end training either
        return None, f"reward raised {type(e).__name__}: {e}"
    try:
        return check_reward(value)
    except Exception as e:  # a weird object whose __repr__/__float__ blows up
        return None, f"reward returned an unusable {type(value).__name__}: {type(e).__name__}"


# -----------------------------------------------------------------------------------------------
# bookkeeping: the (value, error) pairs of a rollout onto its samples


def set_rewards(groups, scored, results, on_failure="drop"):
    """
    Give the samples `scored` (those of `groups` without a reward) their rewards from `results`, a (value, error)
    pair each. A failed reward (value None) is never trained on with on_failure="drop": its loss mask is zeroed and
    it takes the mean reward of its group's good samples, so its advantage is 0 and the others' baseline is not
    biased. With on_failure="zero" it is an ordinary sample with reward 0.0. Returns the failed samples; each
    carries its error in metadata["reward_error"].
    """
    if on_failure not in ("drop", "zero"):
        raise ValueError(f"on_failure must be 'drop' or 'zero', got {on_failure!r}")
    failed = []
    for s, (value, err) in zip(scored, results, strict=True):
        if value is None:
            failed.append(s)
            s.metadata["reward_error"] = err
            if on_failure == "zero":
                value = 0.0
            else:
                s.loss_mask = [0] * s.response_length
        s.reward = value
    if failed and on_failure == "drop":  # the dropped ones, the only samples still without a reward
        for group in groups:
            valid = [s.scalar_reward() for s in group if s.reward is not None]
            fill = sum(valid) / len(valid) if valid else 0.0
            for s in group:
                if s.reward is None:
                    s.reward = fill
    return failed
