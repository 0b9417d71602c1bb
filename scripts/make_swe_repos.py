"""Write the bundled SWE repositories (git, fixed dates: the same commits everywhere) and their
instance files, train.jsonl / test.jsonl / all.jsonl, in SWE-Gym's schema.

    python scripts/make_swe_repos.py [OUT_DIR]     # default: $LIT_MARL_CACHE/swe (~/.cache/lit_marl/swe)

Runs name them as ``swe:bundled:<split>``, which writes them there on first use.
"""

import sys
from pathlib import Path

from lit_marl.envs.swe.bundled import write
from lit_marl.models import cache_dir

if __name__ == "__main__":
    out = Path(sys.argv[1]) if len(sys.argv) > 1 else cache_dir() / "swe"
    for split, path in write(out).items():
        print(f"{split}: {path} ({len(path.read_text().splitlines())} instances)")
