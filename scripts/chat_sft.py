"""
Chat SFT: fine-tune the midtrained model on a small, clean mixture of chat and problems, with a low LR
that decays to zero. Only what the assistant writes is trained on.

    python -m scripts.chat_sft                                    # offline curriculum, from the mid checkpoint
    python -m scripts.chat_sft --source base                      # skip midtraining
    torchrun --nproc_per_node=8 -m scripts.chat_sft --data hub --identity-path identity.jsonl
"""
import sys

from nanorl.common import ArgumentParser
from nanorl.sft import add_train_args, train
from nanorl.sft_data import levels
from tasks import ARC, GSM8K, CustomJSON, OfflineChat, OfflineProblems, SmolTalk, SpellingBee, TaskMixture

parser = ArgumentParser(description="Supervised fine-tuning on packed conversations")
add_train_args(parser, "sft", source="mid", init_lr_frac=0.02, warmdown_ratio=1.0, num_epochs=1)
args = parser.parse_args(sys.argv[1:] if sys.argv[1:2] != ["--"] else sys.argv[2:])  # torchrun ... -m script -- args


def identity():
    return [CustomJSON(path=args.identity_path)] if args.identity_path else []


def offline_mixture():
    n = args.num_examples
    train = TaskMixture([OfflineChat("train", n=n // 2), OfflineProblems("train", n=n, seed=2, levels=levels(args)),
                         SpellingBee("train", size=n // 10)] + identity(), seed=args.seed)
    val = TaskMixture([OfflineProblems("test", n=300, levels=levels(args)), OfflineChat("test", n=200)], seed=args.seed)
    return train, val


def hub_mixture(paths):
    # nanochat's SFT mixture (~23K conversations), plus the offline problems
    train = TaskMixture([ARC("ARC-Easy", "train", path=paths.get("arc-easy")),
                         ARC("ARC-Challenge", "train", path=paths.get("arc-challenge")),
                         GSM8K("train", path=paths.get("gsm8k")),
                         SmolTalk("train", path=paths.get("smoltalk"), stop=10_000),
                         SpellingBee("train", size=600),
                         OfflineProblems("train", n=min(args.num_examples, 5000), seed=2)] + identity(), seed=args.seed)
    val = TaskMixture([SmolTalk("test", path=paths.get("smoltalk"), stop=2000),
                       GSM8K("test", path=paths.get("gsm8k"), stop=500)], seed=args.seed)
    return train, val


if __name__ == "__main__":
    train(args, "sft", hub_mixture, offline_mixture)
