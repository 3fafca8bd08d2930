// Backend kernel of tile_plan (CPU only: a loader-side op; on other devices the torch reference runs).
#include <torch/library.h>

#include "cpu/tile_plan_cpu.h"

TORCH_LIBRARY_IMPL(pyg_quant, CPU, m) { m.impl("tile_plan", &pyg_quant::tile_plan_cpu); }
