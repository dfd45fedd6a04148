"""
A stage of speedrun.sh killed as tests/kill_fixture.py kills one, with speedrun.sh run unchanged: with this directory
on PYTHONPATH, every python the pipeline starts imports this first, and the one running NANORL_TEST_KILL_MODULE arms
NANORL_TEST_KILL (optstep:N or save:S, see kill_fixture.py):

    PYTHONPATH=tests/kill_site NANORL_TEST_KILL_MODULE=scripts.chat_rl NANORL_TEST_KILL=optstep:2 bash speedrun.sh

Under torchrun each rank is `python -u -m <module>`: every rank arms it, and the first to reach the point kills itself.
"""

import os
import sys

argv = [a for a in sys.orig_argv[1:4] if a != "-u"]  # torchrun starts its ranks as python -u -m MODULE
if os.environ.get("NANORL_TEST_KILL") and argv[:2] == ["-m", os.environ.get("NANORL_TEST_KILL_MODULE")]:
    # the repo's nanorl (python -m puts the working directory first, but only after this runs), then the fixture
    sys.path[:0] = [os.getcwd(), os.path.dirname(os.path.dirname(os.path.abspath(__file__)))]
    from kill_fixture import arm

    kind, _, at = os.environ["NANORL_TEST_KILL"].partition(":")
    arm(kind, int(at))
