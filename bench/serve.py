"""HTTP serving benchmark (quickdraft/bench/serving.py); JSON as the last line.

python bench/serve.py --model smollm2-135m --speculative-method ngram          # quick one
python bench/serve.py                                 # qwen2.5-coder-1.5b + 0.5b draft, bf16
Same as `quickdraft bench --serve ...`; results in bench/results/serve-<model>.{json,md,png}.
"""

from __future__ import annotations

import sys

from quickdraft.cli import main

if __name__ == "__main__":
    sys.exit(main(["bench", "--serve", *sys.argv[1:]]))
