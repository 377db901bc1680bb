#!/bin/bash
# Build and run scripts/pass_loop_cycles.cpp against this tree's kernels (or a copy of quant_kernels.cpp given as $1),
# with the kernel build's flags for this CPU (AVX-512 VNNI where it has it, else AVX2); about 40 s to build.
#   bash scripts/pass_loop_cycles.sh [KERNELS.cpp] [GHZ]
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
source=$(realpath "${1:-$root/src/specdraft/models/native/quant_kernels.cpp}")
python=$root/.venv/bin/python
torch_dir=$($python -c "import torch, os; print(os.path.dirname(torch.__file__))")
flags=$($python -c "from specdraft.models.native import kernels; print(' '.join(kernels._flags()))")
py_include=$($python -c "import sysconfig; print(sysconfig.get_paths()['include'])")
py_lib=$($python -c "import sysconfig; print(sysconfig.get_config_var('LIBDIR'))")
py_name=$($python -c "import sysconfig; print(sysconfig.get_config_var('LDLIBRARY'))")
py_name=$(echo "$py_name" | sed 's/^lib//; s/\.so.*//; s/\.a$//')
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
c++ -DKERNEL_SOURCE="\"$source\"" -DTORCH_API_INCLUDE_EXTENSION_H -DTORCH_EXTENSION_NAME=pass_loop_cycles \
  -isystem "$torch_dir/include" -isystem "$torch_dir/include/torch/csrc/api/include" -isystem "$py_include" \
  -I"$root/src/specdraft/models/native" -std=c++20 $flags "$root/scripts/pass_loop_cycles.cpp" \
  -o "$out/pass_loop_cycles" \
  -L"$torch_dir/lib" -lc10 -ltorch_cpu -ltorch -ltorch_python -L"$py_lib" -l"$py_name" \
  -Wl,-rpath,"$torch_dir/lib" -Wl,-rpath,"$py_lib"
"$out/pass_loop_cycles" "${2:-3.66}"
