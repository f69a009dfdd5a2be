// Builds the nanobind module body that hands XLA the FFI handlers of one
// platform: `registrations()` returns {target name: PyCapsule}.
#pragma once

#include <nanobind/nanobind.h>

#include "targets.h"
#include "xla/ffi/api/ffi.h"

#define TE_JAX_DECLARE_HANDLER(name, stem, suffix) XLA_FFI_DECLARE_HANDLER_SYMBOL(stem##suffix);
#define TE_JAX_ADD_CAPSULE(name, stem, suffix) \
  d[#name] = nanobind::capsule(reinterpret_cast<void*>(&stem##suffix));
