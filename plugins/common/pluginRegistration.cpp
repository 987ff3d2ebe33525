// SPDX-License-Identifier: Apache-2.0
// Entry points of libkvexport_plugins.so:
//  - static registration (REGISTER_TENSORRT_PLUGIN): the creators register when the library is loaded
//    (trtexec --staticPlugins, Python ctypes.CDLL). Compiled in unless KVEXPORT_STATIC_REGISTRATION=0.
//  - getCreators / setLoggerFinder (extern "C"): TensorRT's IPluginRegistry::loadLibrary
//    (trtexec --dynamicPlugins, --setPluginsToSerialize, Python registry.load_library).
// loadLibrary dlopens the library (which runs the static registration) and then refuses creators that are registered
// already; so, with static registration compiled in, getCreators first hands the statically registered creators back
// (deregisters them) and returns its own, which TensorRT then registers under the library's handle.
#include "../latent_attention/latentAttentionPlugin.h"
#include "../topk_gather/topKGatherPlugin.h"
#include "kvxDefs.h"
#include "pluginUtils.h"

#include <cstdio>
#include <mutex>

using namespace nvinfer1;

#ifndef KVEXPORT_STATIC_REGISTRATION
#define KVEXPORT_STATIC_REGISTRATION 1
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
REGISTER_TENSORRT_PLUGIN(TopKGatherPluginCreator);
REGISTER_TENSORRT_PLUGIN(LatentAttentionPluginCreator);
#endif

extern "C" KVX_API IPluginCreatorInterface* const* getCreators(int32_t& nbCreators)
{
    static kvexport::TopKGatherPluginCreator sTopKGather;
    static kvexport::LatentAttentionPluginCreator sLatentAttention;
    static IPluginCreatorInterface* const kCreators[] = {&sTopKGather, &sLatentAttention};
#if KVEXPORT_STATIC_REGISTRATION
    IPluginRegistry* registry = getPluginRegistry();
    if (registry != nullptr)
    {
        for (char const* name : {kvexport::TopKGatherPlugin::kNAME, kvexport::LatentAttentionPlugin::kNAME})
        {
            IPluginCreatorInterface* existing
                = registry->getCreator(name, kvexport::kPLUGIN_VERSION, kvexport::kPLUGIN_NAMESPACE);
            if (existing != nullptr && existing != kCreators[0] && existing != kCreators[1])
            {
                registry->deregisterCreator(*existing);
            }
        }
    }
#endif
    nbCreators = 2;
    return kCreators;
}

extern "C" KVX_API void setLoggerFinder(ILoggerFinder* finder)
{
    kvexport::loggerFinder().set(finder);
}
