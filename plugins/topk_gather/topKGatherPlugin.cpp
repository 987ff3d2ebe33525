// SPDX-License-Identifier: Apache-2.0
// TopKGather plugin: shapes and formats for the builder, the kernel launch for the runtime. Every interface method
// is noexcept and turns exceptions into a logged error and a failure code.
#include "topKGatherPlugin.h"

#include "../common/pluginUtils.h"
#include "topKGatherKernel.h"

#include <cstdint>
#include <exception>
#include <memory>
#include <string>

using namespace nvinfer1;

namespace kvexport
{

namespace
{
int32_t fail(std::exception const& e) noexcept
{
    logError(TopKGatherPlugin::kNAME, e.what());
    return -1;
}
} // namespace

TopKGatherPlugin::TopKGatherPlugin(int32_t k)
    : mK(k)
{
    require(k >= 1, "attribute k must be >= 1, got " + std::to_string(k));
}

IPluginCapability* TopKGatherPlugin::getCapabilityInterface(PluginCapabilityType type) noexcept
{
    switch (type)
    {
    case PluginCapabilityType::kCORE: return static_cast<IPluginV3OneCore*>(this);
    case PluginCapabilityType::kBUILD: return static_cast<IPluginV3OneBuild*>(this);
    case PluginCapabilityType::kRUNTIME: return static_cast<IPluginV3OneRuntime*>(this);
    }
    return nullptr;
}

IPluginV3* TopKGatherPlugin::clone() noexcept
{
    try
    {
        return std::make_unique<TopKGatherPlugin>(*this).release();
    }
    catch (std::exception const& e)
    {
        fail(e);
    }
    return nullptr;
}

char const* TopKGatherPlugin::getPluginName() const noexcept
{
    return kNAME;
}

char const* TopKGatherPlugin::getPluginVersion() const noexcept
{
    return kPLUGIN_VERSION;
}

char const* TopKGatherPlugin::getPluginNamespace() const noexcept
{
    return kPLUGIN_NAMESPACE;
}

int32_t TopKGatherPlugin::getNbOutputs() const noexcept
{
    return kNB_OUTPUTS;
}

int32_t TopKGatherPlugin::getOutputDataTypes(
    DataType* outputTypes, int32_t nbOutputs, DataType const* inputTypes, int32_t nbInputs) const noexcept
{
    try
    {
        require(nbInputs == kNB_INPUTS && nbOutputs == kNB_OUTPUTS, "TopKGather takes 4 inputs and has 4 outputs");
        outputTypes[kOUT_KEYS] = inputTypes[kIN_KEYS];
        outputTypes[kOUT_VALUES] = inputTypes[kIN_VALUES];
        outputTypes[kOUT_POSITIONS] = DataType::kINT64;
        outputTypes[kOUT_INDICES] = DataType::kINT64;
        return 0;
    }
    catch (std::exception const& e)
    {
        return fail(e);
    }
}

int32_t TopKGatherPlugin::getOutputShapes(DimsExprs const* inputs, int32_t nbInputs, DimsExprs const* /*shapeInputs*/,
    int32_t /*nbShapeInputs*/, DimsExprs* outputs, int32_t nbOutputs, IExprBuilder& exprBuilder) noexcept
{
    try
    {
        require(nbInputs == kNB_INPUTS && nbOutputs == kNB_OUTPUTS, "TopKGather takes 4 inputs and has 4 outputs");
        DimsExprs const& scores = inputs[kIN_SCORES];
        require(scores.nbDims == 3, "scores must be (B, H, S)");
        require(inputs[kIN_KEYS].nbDims == 4, "keys must be (B, H, S, Dk)");
        require(inputs[kIN_VALUES].nbDims == 4, "values must be (B, H, S, Dv)");
        require(inputs[kIN_POSITIONS].nbDims == 3, "positions must be (B, H, S)");
        if (scores.d[2]->isConstant())
        {
            int64_t const s = scores.d[2]->getConstantValue();
            require(mK <= s, "k = " + std::to_string(mK) + " exceeds the slot count S = " + std::to_string(s));
        }
        IDimensionExpr const* k = exprBuilder.constant(mK);
        for (int32_t o : {kOUT_KEYS, kOUT_VALUES})
        {
            DimsExprs const& src = inputs[o == kOUT_KEYS ? kIN_KEYS : kIN_VALUES];
            outputs[o].nbDims = 4;
            outputs[o].d[0] = src.d[0];
            outputs[o].d[1] = src.d[1];
            outputs[o].d[2] = k;
            outputs[o].d[3] = src.d[3];
        }
        for (int32_t o : {kOUT_POSITIONS, kOUT_INDICES})
        {
            outputs[o].nbDims = 3;
            outputs[o].d[0] = scores.d[0];
            outputs[o].d[1] = scores.d[1];
            outputs[o].d[2] = k;
        }
        return 0;
    }
    catch (std::exception const& e)
    {
        return fail(e);
    }
}

bool TopKGatherPlugin::supportsFormatCombination(
    int32_t pos, DynamicPluginTensorDesc const* inOut, int32_t nbInputs, int32_t nbOutputs) noexcept
{
    if (nbInputs != kNB_INPUTS || nbOutputs != kNB_OUTPUTS || pos < 0 || pos >= nbInputs + nbOutputs)
    {
        return false;
    }
    PluginTensorDesc const& d = inOut[pos].desc;
    if (!isLinear(d))
    {
        return false;
    }
    DataType const keyType = inOut[kIN_KEYS].desc.type;
    switch (pos)
    {
    case kIN_SCORES: return d.type == DataType::kFLOAT; // FP32 only: an FP16 score could change which slots are kept
    case kIN_KEYS: return kvxGatherDType(d.type) >= 0; // float rows, or uint8 codes of a quantized cache
    case kIN_VALUES: return d.type == keyType;
    case kIN_POSITIONS: return d.type == DataType::kINT64;
    case kNB_INPUTS + kOUT_KEYS: return d.type == keyType;
    case kNB_INPUTS + kOUT_VALUES: return d.type == keyType;
    default: return d.type == DataType::kINT64; // kept_positions, kept_indices
    }
}

int32_t TopKGatherPlugin::configurePlugin(
    DynamicPluginTensorDesc const* in, int32_t nbInputs, DynamicPluginTensorDesc const* /*out*/,
    int32_t nbOutputs) noexcept
{
    try
    {
        require(nbInputs == kNB_INPUTS && nbOutputs == kNB_OUTPUTS, "TopKGather takes 4 inputs and has 4 outputs");
        int64_t const minSlots = in[kIN_SCORES].min.d[2];
        require(minSlots < 0 || mK <= minSlots,
            "k = " + std::to_string(mK) + " exceeds the smallest slot count S = " + std::to_string(minSlots));
        return 0;
    }
    catch (std::exception const& e)
    {
        return fail(e);
    }
}

size_t TopKGatherPlugin::getWorkspaceSize(DynamicPluginTensorDesc const* inputs, int32_t nbInputs,
    DynamicPluginTensorDesc const* /*outputs*/, int32_t /*nbOutputs*/) const noexcept
{
    if (nbInputs != kNB_INPUTS)
    {
        return 0;
    }
    Dims const& s = inputs[kIN_SCORES].max; // (B, H, S) at the profile's maximum
    return topKGatherWorkspaceSize(
        static_cast<int32_t>(s.d[0]), static_cast<int32_t>(s.d[1]), static_cast<int32_t>(s.d[2]));
}

void TopKGatherPlugin::checkShapes(PluginTensorDesc const* in, int32_t nbInputs) const
{
    require(nbInputs == kNB_INPUTS, "TopKGather takes 4 inputs");
    Dims const& s = in[kIN_SCORES].dims;
    require(s.nbDims == 3, "scores must be (B, H, S)");
    require(s.d[2] >= mK, "k = " + std::to_string(mK) + " exceeds S = " + std::to_string(s.d[2]));
    for (int32_t i : {kIN_KEYS, kIN_VALUES})
    {
        Dims const& x = in[i].dims;
        require(x.nbDims == 4 && x.d[0] == s.d[0] && x.d[1] == s.d[1] && x.d[2] == s.d[2],
            "keys and values must be (B, H, S, D) with the scores' B, H, S");
    }
    Dims const& p = in[kIN_POSITIONS].dims;
    require(p.nbDims == 3 && p.d[0] == s.d[0] && p.d[1] == s.d[1] && p.d[2] == s.d[2],
        "positions must have the scores' shape (B, H, S)");
}

int32_t TopKGatherPlugin::onShapeChange(
    PluginTensorDesc const* in, int32_t nbInputs, PluginTensorDesc const* /*out*/, int32_t /*nbOutputs*/) noexcept
{
    try
    {
        checkShapes(in, nbInputs);
        return 0;
    }
    catch (std::exception const& e)
    {
        return fail(e);
    }
}

void TopKGatherPlugin::doEnqueue(PluginTensorDesc const* inputDesc, void const* const* inputs, void* const* outputs,
    void* workspace, cudaStream_t stream) const
{
    Dims const& s = inputDesc[kIN_SCORES].dims;
    require(inputDesc[kIN_SCORES].type == DataType::kFLOAT, "scores must be FP32");
    TopKGatherParams p{};
    p.dataType = kvxGatherDType(inputDesc[kIN_KEYS].type);
    p.scores = static_cast<float const*>(inputs[kIN_SCORES]);
    p.keys = inputs[kIN_KEYS];
    p.values = inputs[kIN_VALUES];
    p.positions = static_cast<int64_t const*>(inputs[kIN_POSITIONS]);
    p.batch = static_cast<int32_t>(s.d[0]);
    p.heads = static_cast<int32_t>(s.d[1]);
    p.slots = static_cast<int32_t>(s.d[2]);
    p.keyDim = static_cast<int32_t>(inputDesc[kIN_KEYS].dims.d[3]);
    p.valueDim = static_cast<int32_t>(inputDesc[kIN_VALUES].dims.d[3]);
    p.k = mK;
    p.keptKeys = outputs[kOUT_KEYS];
    p.keptValues = outputs[kOUT_VALUES];
    p.keptPositions = static_cast<int64_t*>(outputs[kOUT_POSITIONS]);
    p.keptIndices = static_cast<int64_t*>(outputs[kOUT_INDICES]);
    p.workspace = workspace;
    p.workspaceSize = topKGatherWorkspaceSize(p.batch, p.heads, p.slots);
    cudaError_t const e = launchTopKGather(p, stream);
    require(e == cudaSuccess, std::string("kernel launch failed: ") + cudaGetErrorString(e));
}

int32_t TopKGatherPlugin::enqueue(PluginTensorDesc const* inputDesc, PluginTensorDesc const* /*outputDesc*/,
    void const* const* inputs, void* const* outputs, void* workspace, cudaStream_t stream) noexcept
{
    try
    {
        doEnqueue(inputDesc, inputs, outputs, workspace, stream);
        return 0;
    }
    catch (std::exception const& e)
    {
        return fail(e);
    }
}

IPluginV3* TopKGatherPlugin::attachToContext(IPluginResourceContext* /*context*/) noexcept
{
    return clone();
}

PluginFieldCollection const* TopKGatherPlugin::getFieldsToSerialize() noexcept
{
    mSerialFields.clear();
    mSerialFields.emplace_back("k", &mK, PluginFieldType::kINT32, 1);
    mSerialFc.nbFields = static_cast<int32_t>(mSerialFields.size());
    mSerialFc.fields = mSerialFields.data();
    return &mSerialFc;
}

// ---------------------------------------------------------------------------------------------------------------
// Creator

TopKGatherPluginCreator::TopKGatherPluginCreator()
{
    mFields.emplace_back("k", nullptr, PluginFieldType::kINT32, 1);
    mFc.nbFields = static_cast<int32_t>(mFields.size());
    mFc.fields = mFields.data();
}

char const* TopKGatherPluginCreator::getPluginName() const noexcept
{
    return TopKGatherPlugin::kNAME;
}

char const* TopKGatherPluginCreator::getPluginVersion() const noexcept
{
    return kPLUGIN_VERSION;
}

char const* TopKGatherPluginCreator::getPluginNamespace() const noexcept
{
    return kPLUGIN_NAMESPACE;
}

PluginFieldCollection const* TopKGatherPluginCreator::getFieldNames() noexcept
{
    return &mFc;
}

int32_t TopKGatherPluginCreator::parseK(PluginFieldCollection const* fc)
{
    require(fc != nullptr, "no attributes given; TopKGather needs k");
    int64_t k = -1;
    for (int32_t i = 0; i < fc->nbFields; ++i)
    {
        if (fieldIs(fc->fields[i], "k"))
        {
            k = fieldInt(fc->fields[i]);
        }
    }
    require(k != -1, "attribute k is missing (the number of slots kept, 1 <= k <= S)");
    require(k >= 1 && k <= INT32_MAX, "attribute k = " + std::to_string(k) + " is outside [1, 2^31 - 1]");
    return static_cast<int32_t>(k);
}

IPluginV3* TopKGatherPluginCreator::createPlugin(
    char const* /*name*/, PluginFieldCollection const* fc, TensorRTPhase /*phase*/) noexcept
{
    try
    {
        return std::make_unique<TopKGatherPlugin>(parseK(fc)).release();
    }
    catch (std::exception const& e)
    {
        fail(e);
    }
    return nullptr;
}

} // namespace kvexport
