# Sourced (not run) by tools/gpu_check and tools/gpu_image_env: puts every forge package's source
# tree and the repository root (for tests/ and tools/) on PYTHONPATH, so forge runs from a
# checkout with an interpreter that has torch and triton but no forge installed (the lent GPU
# machines have no network, hence no `uv sync`).
forge_root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
forge_path=$forge_root/kernels/src
for forge_src in "$forge_root"/packages/*/src; do
  forge_path=$forge_path:$forge_src
done
export PYTHONPATH="$forge_path:$forge_root${PYTHONPATH:+:$PYTHONPATH}"
unset forge_path forge_src
