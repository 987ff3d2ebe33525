// SPDX-License-Identifier: Apache-2.0
// Entry points of libkvexport_plugins.so, as TensorRT documents them for plugin libraries:
//  - getCreators / setLoggerFinder (extern "C"): IPluginRegistry::loadLibrary, trtexec --dynamicPlugins,
//    --setPluginsToSerialize, Python registry.load_library. The library registers nothing itself, so it needs no
//    libnvinfer at link time (the lean runtime can load it) and loadLibrary finds no duplicate creators.
//  - load-time registration (REGISTER_TENSORRT_PLUGIN, for trtexec --staticPlugins or ctypes.CDLL) only when built
//    with -DKVEXPORT_STATIC_REGISTRATION=ON (CMake option of the same name, default OFF). Such a build registers
//    its creators when it is loaded and links libnvinfer; do not also hand it to loadLibrary / --dynamicPlugins,
//    which would then see the same creators twice.
#include "../latent_attention/latentAttentionPlugin.h"
#include "../topk_gather/topKGatherPlugin.h"
#include "kvxDefs.h"
#include "pluginUtils.h"

#include <cstdio>
#include <mutex>

using namespace nvinfer1;

#ifndef KVEXPORT_STATIC_REGISTRATION
#define KVEXPORT_STATIC_REGISTRATION 0
#endif

namespace kvexport
{
namespace
{

class LoggerFinderHolder
{
public:
    void set(ILoggerFinder* finder) noexcept
    {
        std::lock_guard<std::mutex> lock(mMutex);
        if (mFinder == nullptr && finder != nullptr)
        {
            mFinder = finder;
        }
    }

    ILogger* logger() noexcept
    {
        std::lock_guard<std::mutex> lock(mMutex);
        return mFinder != nullptr ? mFinder->findLogger() : nullptr;
    }

private:
    std::mutex mMutex;
    ILoggerFinder* mFinder{nullptr};
};

LoggerFinderHolder& loggerFinder() noexcept
{
    static LoggerFinderHolder holder;
    return holder;
}

} // namespace

ILogger* pluginLogger() noexcept
{
    return loggerFinder().logger();
}

void logError(char const* plugin, char const* msg) noexcept
{
    char line[1024];
    std::snprintf(line, sizeof(line), "[kvexport::%s] %s", plugin, msg);
    ILogger* logger = pluginLogger();
    if (logger != nullptr)
    {
        logger->log(ILogger::Severity::kERROR, line);
    }
    else
    {
        std::fprintf(stderr, "%s\n", line);
    }
}

} // namespace kvexport

#if KVEXPORT_STATIC_REGISTRATION
using kvexport::LatentAttentionPluginCreator;
using kvexport::TopKGatherPluginCreator;
namespace
{
//! plugin_version "2" of LatentAttention (new_latent, latent_scale, latent_format)
class LatentAttentionV2PluginCreator : public LatentAttentionPluginCreator
{
public:
    LatentAttentionV2PluginCreator()
        : LatentAttentionPluginCreator(2)
    {
    }
};
} // namespace
REGISTER_TENSORRT_PLUGIN(TopKGatherPluginCreator);
REGISTER_TENSORRT_PLUGIN(LatentAttentionPluginCreator);
REGISTER_TENSORRT_PLUGIN(LatentAttentionV2PluginCreator);
#endif

extern "C" KVX_API IPluginCreatorInterface* const* getCreators(int32_t& nbCreators)
{
    static kvexport::TopKGatherPluginCreator sTopKGather;
    static kvexport::LatentAttentionPluginCreator sLatentAttention(1);
    static kvexport::LatentAttentionPluginCreator sLatentAttentionV2(2);
    static IPluginCreatorInterface* const kCreators[] = {&sTopKGather, &sLatentAttention, &sLatentAttentionV2};
    nbCreators = 3;
    return kCreators;
}

extern "C" KVX_API void setLoggerFinder(ILoggerFinder* finder)
{
    kvexport::loggerFinder().set(finder);
}
