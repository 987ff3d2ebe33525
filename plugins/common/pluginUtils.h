// SPDX-License-Identifier: Apache-2.0
// Helpers shared by the kvexport TensorRT plugins: logging through TensorRT's logger finder, attribute parsing,
// data-type mapping. Header-only apart from the logger (pluginRegistration.cpp).
#pragma once

#include "NvInferRuntime.h"
#include "NvInferRuntimePlugin.h"

#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <string>

//! BF16 I/O: on for every sm_80+ build (all architectures this project targets); -DKVEXPORT_ENABLE_BF16=0 turns it off.
#ifndef KVEXPORT_ENABLE_BF16
#define KVEXPORT_ENABLE_BF16 1
#endif

namespace kvexport
{

//! Plugin namespace of every kvexport plugin: the ONNX nodes carry plugin_namespace = "kvexport".
constexpr char const* kPLUGIN_NAMESPACE = "kvexport";
//! Version of every kvexport plugin (ONNX plugin_version = "1").
constexpr char const* kPLUGIN_VERSION = "1";

//! The logger TensorRT handed over through setLoggerFinder(), or null (then messages go to stderr).
nvinfer1::ILogger* pluginLogger() noexcept;

//! Logs `msg` as an error prefixed with the plugin name.
void logError(char const* plugin, char const* msg) noexcept;

//! Thrown by the throwing helpers; the noexcept interface methods catch it and log it.
class PluginError : public std::runtime_error
{
public:
    using std::runtime_error::runtime_error;
};

inline void require(bool ok, std::string const& what)
{
    if (!ok)
    {
        throw PluginError(what);
    }
}

//! Integer attribute value; the ONNX parser passes INT attributes as kINT32 (kINT64 accepted too).
inline int64_t fieldInt(nvinfer1::PluginField const& f)
{
    require(f.data != nullptr && f.length >= 1, std::string("attribute ") + f.name + " has no value");
    switch (f.type)
    {
    case nvinfer1::PluginFieldType::kINT32: return *static_cast<int32_t const*>(f.data);
    case nvinfer1::PluginFieldType::kINT64: return *static_cast<int64_t const*>(f.data);
    case nvinfer1::PluginFieldType::kINT16: return *static_cast<int16_t const*>(f.data);
    case nvinfer1::PluginFieldType::kINT8: return *static_cast<int8_t const*>(f.data);
    default: break;
    }
    throw PluginError(std::string("attribute ") + f.name + " must be an integer");
}

//! Float attribute value (kFLOAT32 from the ONNX parser; kFLOAT64 accepted).
inline float fieldFloat(nvinfer1::PluginField const& f)
{
    require(f.data != nullptr && f.length >= 1, std::string("attribute ") + f.name + " has no value");
    switch (f.type)
    {
    case nvinfer1::PluginFieldType::kFLOAT32: return *static_cast<float const*>(f.data);
    case nvinfer1::PluginFieldType::kFLOAT64: return static_cast<float>(*static_cast<double const*>(f.data));
    default: break;
    }
    throw PluginError(std::string("attribute ") + f.name + " must be a float");
}

inline bool fieldIs(nvinfer1::PluginField const& f, char const* name)
{
    return f.name != nullptr && std::strcmp(f.name, name) == 0;
}

//! TensorRT data type -> KvxDType code of the kernels (-1 when unsupported).
inline int32_t kvxDType(nvinfer1::DataType t)
{
    switch (t)
    {
    case nvinfer1::DataType::kFLOAT: return 0;
    case nvinfer1::DataType::kHALF: return 1;
#if KVEXPORT_ENABLE_BF16
    case nvinfer1::DataType::kBF16: return 2;
#endif
    default: return -1;
    }
}

//! Element types TopKGather gathers: the float types and UINT8 (a quantized cache's codes, copied as bytes).
inline int32_t kvxGatherDType(nvinfer1::DataType t)
{
    return t == nvinfer1::DataType::kUINT8 ? 3 : kvxDType(t);
}

//! Float element types the kernels take: FP32, FP16 and (when KVEXPORT_ENABLE_BF16, all sm_80+ builds) BF16.
inline bool isFloatType(nvinfer1::DataType t)
{
    return kvxDType(t) >= 0;
}

inline bool isLinear(nvinfer1::PluginTensorDesc const& d)
{
    return d.format == nvinfer1::TensorFormat::kLINEAR;
}

} // namespace kvexport

