"""
Runs a training stage as `python -m <module>` would, with what only a GPU run does switched on for the CPU: the
batch-size trial (out of memory counts as caught, as on CUDA) and torch.compile (dynamo with the eager backend: the
graphs are made, not lowered). At the end each rank prints how many graphs dynamo compiled:

    torchrun --nproc_per_node=2 tests/compile_fixture.py scripts.base_train -- --depth 2 ...
        ... compiled graphs: 1
"""

import os
import runpy
import sys

if __name__ == "__main__":
    sys.path.insert(0, os.getcwd())  # the repo's nanorl/ and scripts/, before anything imports an installed copy
    import torch
    from torch._dynamo.utils import counters

    import nanorl.batch_fit

    nanorl.batch_fit.oom_is_catchable = lambda device: True
    nanorl.batch_fit.compile_model = lambda model, device, no_compile=False: torch.compile(
        model, dynamic=False, backend="eager"
    )
    module, argv = sys.argv[1], sys.argv[2:]
    sys.argv = [module] + (argv[1:] if argv[:1] == ["--"] else argv)
    runpy.run_module(module, run_name="__main__", alter_sys=True)
    print(f"rank {os.environ.get('RANK', 0)}: compiled graphs: {counters['stats']['unique_graphs']}", flush=True)
