"""Speculative decoding A/B: `quickdraft bench` (quickdraft/bench/speculative.py) under another
name, with the same flags; JSON + markdown + PNG in bench/results/, the JSON as the last line.

python bench/speculative.py --max-tokens 128                # every prompt; references on 2 per set
python bench/speculative.py --sets code --reference-per-set 0          # code only, ours only
"""

from __future__ import annotations

import sys

from quickdraft.cli import main

if __name__ == "__main__":
    sys.exit(main(["bench", *sys.argv[1:]]))
