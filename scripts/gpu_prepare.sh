#!/usr/bin/env bash
# Prepares .gpu/, the ignored folder scripts/gpu_bench.sh reads on a GPU machine (carry it with
# the device tool's `carry: [".gpu"]`; about 10 MB):
#   .gpu/tokenizer/  the default model's tokenizer files (the random-weight shapes' vocabulary)
#   .gpu/baseline/   an older metaloom package for the baseline rows (default: c73a4ef, the
#                    engine before CUDA graphs and the batched draw)
# usage: bash scripts/gpu_prepare.sh [COMMIT]
set -euo pipefail
cd "$(dirname "$0")/.."
commit=${1:-c73a4ef}
grep -qx '/.gpu/' .git/info/exclude 2>/dev/null || echo '/.gpu/' >> .git/info/exclude
rm -rf .gpu/tokenizer .gpu/baseline
mkdir -p .gpu/tokenizer .gpu/baseline
HF_HUB_OFFLINE=1 .venv/bin/python - <<'PY'
import os, shutil
from metaloom.models.find import converted_folder, default_model_path
folder = converted_folder(default_model_path())
for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja", "config.json"):
    if os.path.exists(os.path.join(folder, name)):
        shutil.copy(os.path.join(folder, name), ".gpu/tokenizer/")
print("tokenizer files from", folder, ":", sorted(os.listdir(".gpu/tokenizer")))
PY
git archive "$commit" metaloom | tar -x -C .gpu/baseline
du -sh .gpu
