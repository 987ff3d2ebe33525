// SPDX-License-Identifier: Apache-2.0
// Export macro and version of the kvexport kernel C interface.
#pragma once

#if defined(_WIN32)
#define KVX_API __declspec(dllexport)
#else
#define KVX_API __attribute__((visibility("default")))
#endif

//! Bumped when a kvx_* signature changes; kvx_abi_version() returns it.
#define KVX_ABI_VERSION 2
