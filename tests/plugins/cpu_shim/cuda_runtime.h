// SPDX-License-Identifier: Apache-2.0
// CPU shim stand-in for <cuda_runtime.h> (tests/plugins/cpu_shim; see kvx_cpu_shim.h).
#pragma once
#include "kvx_cpu_shim.h"
