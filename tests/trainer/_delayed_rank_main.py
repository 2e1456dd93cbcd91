"""``nemo-fp8rl-train`` with one rank made slow, to test that ranks agree on "fresh or resume".

Usage (under torchrun): ``_delayed_rank_main.py <hydra overrides>`` with ``DELAY_RANK`` and
``DELAY_SECONDS`` in the environment. The delayed rank sleeps inside the warm-up, i.e. after the run
directory was judged and before the trainer writes to it: a rank that judged the directory on its own
would now see the other rank's ``metrics.jsonl`` and refuse a fresh run. Everything else is the real CLI.
"""

import os
import sys
import time

import nemo_fp8rl.trainer as trainer_pkg
from nemo_fp8rl.train import main

_warmup = trainer_pkg.run_warmup


def _slow_warmup(*args, **kwargs):
    print(f"_delayed_rank_main: rank {os.environ['RANK']} sleeps {os.environ['DELAY_SECONDS']} s", file=sys.stderr,
          flush=True)  # the test checks that the delay happened
    time.sleep(float(os.environ["DELAY_SECONDS"]))
    return _warmup(*args, **kwargs)


if os.environ.get("RANK") == os.environ.get("DELAY_RANK"):
    trainer_pkg.run_warmup = _slow_warmup

if __name__ == "__main__":
    main()
