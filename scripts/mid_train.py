"""
Midtraining: teach a base model the conversation format, tool calls and the kind of problems it will
later be asked, on a mixture heavier on problems and tool use than SFT's.

The training loop is SFT's: train() in scripts/chat_sft.py, called here with midtraining's mixture and defaults
(from the base model, the full base LRs, a decay over the last 20% of steps).

    python -m scripts.mid_train                                   # offline curriculum, from the base checkpoint
    python -m scripts.mid_train --data hub --identity-path identity.jsonl
    torchrun --nproc_per_node=8 -m scripts.mid_train --data hub --device-batch-size 32
"""

from nanorl import fsdp, lora
from nanorl.flags import ArgumentParser
from nanorl.sft_data import levels
from scripts.chat_sft import add_train_args, mixture, offline_val, train
from tasks import GSM8K, MMLU, OfflineChat, OfflineProblems, SmolTalk, SpellingBee, TaskMixture

IDENTITY_COPIES = 2  # a few hundred identity conversations would otherwise be lost in midtraining's larger mixture


def offline_mixture(args):
    n = args.num_examples
    # half the problems with tool calls (the skill midtraining is for), half in plain text
    train = mixture(
        args,
        [
            OfflineProblems("train", n=n, levels=levels(args), use_tools=True),
            OfflineProblems("train", n=n, seed=1, levels=levels(args)),
            SpellingBee("train", size=n // 4),
            OfflineChat("train", n=n // 2),
        ],
        IDENTITY_COPIES,
    )
    return train, offline_val(args)


def hub_mixture(args, paths):
    train = mixture(
        args,
        [
            SmolTalk("train", path=paths.get("smoltalk")),
            MMLU("train", subset="auxiliary_train", path=paths.get("mmlu-aux")),
            GSM8K("train", path=paths.get("gsm8k")),
            SpellingBee("train", size=50_000),
            OfflineProblems("train", n=args.num_examples, use_tools=True),
        ],
        IDENTITY_COPIES,
    )
    val = TaskMixture(
        [
            SmolTalk("test", path=paths.get("smoltalk"), stop=5000),
            MMLU("test", path=paths.get("mmlu"), stop=2000),
            GSM8K("test", path=paths.get("gsm8k"), stop=500),
        ],
        seed=args.seed,
    )
    return train, val


def main():
    parser = ArgumentParser(description="Midtraining on packed conversations")
    add_train_args(parser, "mid", source="base", init_lr_frac=1.0, warmdown_ratio=0.2, num_epochs=1)
    args = parser.parse_args()
    fsdp.check_args(args, "mid_train")
    lora.check_args(args, parser)
    train(args, "mid", hub_mixture, offline_mixture)


if __name__ == "__main__":
    main()
