"""
Runs a stage as `python -m <module>` would, and SIGKILLs its own process at a chosen point, as a preempted node or
the OOM killer would (no handler runs, nothing is flushed but what was written):

    NANORL_TEST_KILL=optstep:N python tests/kill_fixture.py scripts.chat_rl --num-rollouts 4 ...
        on entering the N-th step of the first optimizer this process builds (mid-run, between two saves)
    NANORL_TEST_KILL=save:S python tests/kill_fixture.py scripts.base_train ...
        in the middle of saving step S: every file of the step is written except its meta_<S>.json, which marks a
        step complete (rank 0 writes it last)

Under torchrun (`torchrun ... tests/kill_fixture.py scripts.chat_rl -- ...`) every rank runs this; a rank that reaches
the point kills itself and torchrun stops the others. Without NANORL_TEST_KILL the stage runs untouched.
"""

import os
import runpy
import signal
import sys


def die():
    sys.stdout.flush()
    sys.stderr.flush()
    os.kill(os.getpid(), signal.SIGKILL)


def arm(kind, at):
    if kind == "optstep":
        from nanorl.optim import MuonAdamW

        step, first, count = MuonAdamW.step, [], [0]

        def counted_step(self, *a, **kw):
            first.append(self) if not first else None
            if self is first[0]:  # the policy's optimizer (PPO's critic has a second one)
                count[0] += 1
                if count[0] == at:
                    die()
            return step(self, *a, **kw)

        MuonAdamW.step = counted_step
    elif kind == "save":
        from nanorl import checkpoint

        write_json = checkpoint._atomic_json

        def killed_before_meta(obj, path):
            if os.path.basename(path) == f"meta_{at:06d}.json":
                die()
            return write_json(obj, path)

        checkpoint._atomic_json = killed_before_meta
    else:
        raise SystemExit(f"NANORL_TEST_KILL={kind}:{at}: use optstep:N or save:S")


if __name__ == "__main__":
    # python -m puts the working directory first: the repo's scripts/ and nanorl/ (before arm() imports nanorl, so an
    # installed copy of the package elsewhere is not the one patched and run)
    sys.path.insert(0, os.getcwd())
    spec = os.environ.get("NANORL_TEST_KILL")
    if spec:
        kind, _, at = spec.partition(":")
        arm(kind, int(at))
    module, argv = sys.argv[1], sys.argv[2:]
    if argv[:1] == ["--"]:
        argv = argv[1:]
    sys.argv = [module] + argv
    runpy.run_module(module, run_name="__main__", alter_sys=True)
