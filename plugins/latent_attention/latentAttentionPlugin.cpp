// SPDX-License-Identifier: Apache-2.0
// LatentAttention plugin: shapes, formats and workspace for the builder, the kernel launch for the runtime. Every
// interface method is noexcept and turns exceptions into a logged error and a failure code.
#include "latentAttentionPlugin.h"

#include "../common/pluginUtils.h"
#include "latentAttentionKernel.h"

#include <cmath>
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
    logError(LatentAttentionPlugin::kNAME, e.what());
    return -1;
}

char const* versionString(int32_t version) noexcept
{
    return version == 2 ? "2" : kPLUGIN_VERSION;
}

// The latent's slot count S and width R + Dr: (B, S, R + Dr), or in version 2 also (B, 1, S, R + Dr), the
// exporter's one-head cache buffer as it is (TensorRT reshapes no UINT8 tensor, so a quantized cache's codes reach
// the plugin in their buffer's shape; the bytes are the same).
int64_t latentSlots(Dims const& latent) noexcept
{
    return latent.nbDims >= 2 ? latent.d[latent.nbDims - 2] : -1;
}

int64_t latentWidth(Dims const& latent) noexcept
{
    return latent.nbDims >= 1 ? latent.d[latent.nbDims - 1] : -1;
}

void requireFormat(int64_t format)
{
    require(format >= kLatentFormatNone && format <= kLatentFormatFp8,
        "attribute latent_format = " + std::to_string(format) + " is not 0 (float), 1 (int8) or 2 (fp8)");
}
} // namespace

LatentAttentionPlugin::LatentAttentionPlugin(int32_t rank, float scale, int32_t version, int32_t latentFormat)
    : mRank(rank)
    , mScale(scale)
    , mVersion(version)
    , mLatentFormat(latentFormat)
{
    require(rank >= 1 && rank <= kLatentAttentionMaxRank,
        "attribute rank = " + std::to_string(rank) + " is outside [1, " + std::to_string(kLatentAttentionMaxRank)
            + "]");
    require(std::isfinite(scale) && scale > 0.0F, "attribute scale must be a positive finite float");
    require(version == 1 || version == 2, "plugin version must be 1 or 2");
    requireFormat(latentFormat);
    require(version == 2 || latentFormat == kLatentFormatNone, "latent_format needs plugin version 2");
}

LatentAttentionPlugin::LatentAttentionPlugin(LatentAttentionPlugin const& other)
    : mRank(other.mRank)
    , mScale(other.mScale)
    , mVersion(other.mVersion)
    , mLatentFormat(other.mLatentFormat)
    , mNbInputs(other.mNbInputs)
{
    // a clone (attachToContext: another execution context, maybe another device) queries its device again
}

IPluginCapability* LatentAttentionPlugin::getCapabilityInterface(PluginCapabilityType type) noexcept
{
    switch (type)
    {
    case PluginCapabilityType::kCORE: return static_cast<IPluginV3OneCore*>(this);
    case PluginCapabilityType::kBUILD: return static_cast<IPluginV3OneBuild*>(this);
    case PluginCapabilityType::kRUNTIME: return static_cast<IPluginV3OneRuntime*>(this);
    }
    return nullptr;
}

IPluginV3* LatentAttentionPlugin::clone() noexcept
{
    try
    {
        return std::make_unique<LatentAttentionPlugin>(*this).release();
    }
    catch (std::exception const& e)
    {
        fail(e);
    }
    return nullptr;
}

char const* LatentAttentionPlugin::getPluginName() const noexcept
{
    return kNAME;
}

char const* LatentAttentionPlugin::getPluginVersion() const noexcept
{
    return versionString(mVersion);
}

bool LatentAttentionPlugin::acceptsInputs(int32_t nbInputs) const noexcept
{
    if (mVersion == 1)
    {
        return nbInputs == kNB_INPUTS;
    }
    return mLatentFormat == kLatentFormatNone ? (nbInputs >= kNB_INPUTS && nbInputs <= kMAX_INPUTS)
                                              : nbInputs == kMAX_INPUTS;
}

void LatentAttentionPlugin::requireInputs(int32_t nbInputs) const
{
    require(acceptsInputs(nbInputs),
        mVersion == 1 ? std::string("LatentAttention version 1 takes 4 inputs")
                      : "LatentAttention version 2 takes q, latent, q_positions, latent_positions, new_latent and "
                        "(a quantized latent: needed) latent_scale; got "
                + std::to_string(nbInputs) + " inputs");
}

char const* LatentAttentionPlugin::getPluginNamespace() const noexcept
{
    return kPLUGIN_NAMESPACE;
}

int32_t LatentAttentionPlugin::getNbOutputs() const noexcept
{
    return kNB_OUTPUTS;
}

int32_t LatentAttentionPlugin::getOutputDataTypes(
    DataType* outputTypes, int32_t nbOutputs, DataType const* inputTypes, int32_t nbInputs) const noexcept
{
    try
    {
        requireInputs(nbInputs);
        require(nbOutputs == kNB_OUTPUTS, "LatentAttention has 1 output");
        outputTypes[kOUT_OUT] = inputTypes[kIN_Q];
        return 0;
    }
    catch (std::exception const& e)
    {
        return fail(e);
    }
}

int32_t LatentAttentionPlugin::getOutputShapes(DimsExprs const* inputs, int32_t nbInputs,
    DimsExprs const* /*shapeInputs*/, int32_t /*nbShapeInputs*/, DimsExprs* outputs, int32_t nbOutputs,
    IExprBuilder& exprBuilder) noexcept
{
    try
    {
        requireInputs(nbInputs);
        require(nbOutputs == kNB_OUTPUTS, "LatentAttention has 1 output");
        DimsExprs const& q = inputs[kIN_Q];
        DimsExprs const& latent = inputs[kIN_LATENT];
        require(q.nbDims == 4, "q must be (B, Hq, T, R + Dr)");
        bool const oneHead = mVersion == 2 && latent.nbDims == 4
            && (!latent.d[1]->isConstant() || latent.d[1]->getConstantValue() == 1);
        require(latent.nbDims == 3 || oneHead,
            mVersion == 2 ? "latent must be (B, S, R + Dr) or (B, 1, S, R + Dr)" : "latent must be (B, S, R + Dr)");
        require(inputs[kIN_Q_POSITIONS].nbDims == 2, "q_positions must be (B, T)");
        require(inputs[kIN_LATENT_POSITIONS].nbDims == 2, "latent_positions must be (B, S)");
        require(nbInputs <= kIN_NEW_LATENT || inputs[kIN_NEW_LATENT].nbDims == 3, "new_latent must be (B, T, R + Dr)");
        require(nbInputs <= kIN_LATENT_SCALE || inputs[kIN_LATENT_SCALE].nbDims == 2, "latent_scale must be (B, S)");
        if (q.d[3]->isConstant())
        {
            int64_t const d = q.d[3]->getConstantValue();
            require(d >= mRank && d <= kLatentAttentionMaxDim,
                "the latent width R + Dr = " + std::to_string(d) + " must be in [rank, "
                    + std::to_string(kLatentAttentionMaxDim) + "]");
        }
        outputs[kOUT_OUT].nbDims = 4;
        outputs[kOUT_OUT].d[0] = q.d[0];
        outputs[kOUT_OUT].d[1] = q.d[1];
        outputs[kOUT_OUT].d[2] = q.d[2];
        outputs[kOUT_OUT].d[3] = exprBuilder.constant(mRank);
        return 0;
    }
    catch (std::exception const& e)
    {
        return fail(e);
    }
}

bool LatentAttentionPlugin::supportsFormatCombination(
    int32_t pos, DynamicPluginTensorDesc const* inOut, int32_t nbInputs, int32_t nbOutputs) noexcept
{
    if (!acceptsInputs(nbInputs) || nbOutputs != kNB_OUTPUTS || pos < 0 || pos >= nbInputs + nbOutputs)
    {
        return false;
    }
    PluginTensorDesc const& d = inOut[pos].desc;
    if (!isLinear(d))
    {
        return false;
    }
    DataType const qType = inOut[kIN_Q].desc.type;
    if (pos == nbInputs + kOUT_OUT)
    {
        return d.type == qType;
    }
    switch (pos)
    {
    case kIN_Q: return isFloatType(d.type);
    case kIN_LATENT: return mLatentFormat != kLatentFormatNone ? d.type == DataType::kUINT8 : d.type == qType;
    case kIN_Q_POSITIONS: return d.type == DataType::kINT64;
    case kIN_LATENT_POSITIONS: return d.type == DataType::kINT64;
    case kIN_NEW_LATENT: return d.type == qType;
    case kIN_LATENT_SCALE: return d.type == DataType::kHALF;
    default: return false;
    }
}

int32_t LatentAttentionPlugin::configurePlugin(
    DynamicPluginTensorDesc const* in, int32_t nbInputs, DynamicPluginTensorDesc const* /*out*/,
    int32_t nbOutputs) noexcept
{
    try
    {
        requireInputs(nbInputs);
        require(nbOutputs == kNB_OUTPUTS, "LatentAttention has 1 output");
        int64_t const d = in[kIN_Q].desc.dims.d[3];
        int64_t const dl = latentWidth(in[kIN_LATENT].desc.dims);
        require(d < 0 || dl < 0 || d == dl, "q and latent must have the same last dimension R + Dr");
        if (nbInputs > kIN_NEW_LATENT)
        {
            int64_t const dn = in[kIN_NEW_LATENT].desc.dims.d[2];
            require(d < 0 || dn < 0 || d == dn, "q and new_latent must have the same last dimension R + Dr");
        }
        mNbInputs = nbInputs;
        return 0;
    }
    catch (std::exception const& e)
    {
        return fail(e);
    }
}

size_t LatentAttentionPlugin::getWorkspaceSize(DynamicPluginTensorDesc const* inputs, int32_t nbInputs,
    DynamicPluginTensorDesc const* /*outputs*/, int32_t /*nbOutputs*/) const noexcept
{
    if (!acceptsInputs(nbInputs))
    {
        return 0;
    }
    Dims const& q = inputs[kIN_Q].max;         // (B, Hq, T, D) at the profile's maximum
    Dims const& latent = inputs[kIN_LATENT].max; // (B, S, D) or (B, 1, S, D)
    int64_t const newRows = nbInputs > kIN_NEW_LATENT ? q.d[2] : 0; // new_latent's T rows follow the S slots
    return latentAttentionWorkspaceSize(static_cast<int32_t>(q.d[0]), static_cast<int32_t>(q.d[1]),
        static_cast<int32_t>(q.d[2]), static_cast<int32_t>(latentSlots(latent) + newRows), static_cast<int32_t>(q.d[3]),
        mRank);
}

void LatentAttentionPlugin::checkShapes(PluginTensorDesc const* in, int32_t nbInputs) const
{
    requireInputs(nbInputs);
    Dims const& q = in[kIN_Q].dims;
    Dims const& latent = in[kIN_LATENT].dims;
    bool const oneHead = mVersion == 2 && latent.nbDims == 4 && latent.d[1] == 1;
    require(q.nbDims == 4 && (latent.nbDims == 3 || oneHead),
        mVersion == 2 ? "q must be (B, Hq, T, D) and latent (B, S, D) or (B, 1, S, D)"
                      : "q must be (B, Hq, T, D) and latent (B, S, D)");
    int64_t const slots = latentSlots(latent);
    require(latent.d[0] == q.d[0] && latentWidth(latent) == q.d[3], "latent must have q's B and D");
    require(q.d[3] >= mRank, "the latent width D must be >= rank");
    Dims const& qp = in[kIN_Q_POSITIONS].dims;
    Dims const& lp = in[kIN_LATENT_POSITIONS].dims;
    require(qp.nbDims == 2 && qp.d[0] == q.d[0] && qp.d[1] == q.d[2], "q_positions must be (B, T)");
    require(lp.nbDims == 2 && lp.d[0] == q.d[0] && lp.d[1] == slots, "latent_positions must be (B, S)");
    if (nbInputs > kIN_NEW_LATENT)
    {
        Dims const& nl = in[kIN_NEW_LATENT].dims;
        require(nl.nbDims == 3 && nl.d[0] == q.d[0] && nl.d[1] == q.d[2] && nl.d[2] == q.d[3],
            "new_latent must be (B, T, D) with q's B, T and D");
    }
    if (nbInputs > kIN_LATENT_SCALE)
    {
        Dims const& ls = in[kIN_LATENT_SCALE].dims;
        require(ls.nbDims == 2 && ls.d[0] == q.d[0] && ls.d[1] == slots, "latent_scale must be (B, S)");
    }
}

int32_t LatentAttentionPlugin::onShapeChange(
    PluginTensorDesc const* in, int32_t nbInputs, PluginTensorDesc const* /*out*/, int32_t /*nbOutputs*/) noexcept
{
    try
    {
        checkShapes(in, nbInputs);
        mNbInputs = nbInputs;
        ensureDevice();
        return 0;
    }
    catch (std::exception const& e)
    {
        return fail(e);
    }
}

void LatentAttentionPlugin::ensureDevice()
{
    if (mDeviceReady)
    {
        return;
    }
    cudaError_t e = queryDevice(mDevice);
    if (e == cudaSuccess)
    {
        e = prepareLatentAttention(mDevice);
    }
    require(e == cudaSuccess, std::string("device query failed: ") + cudaGetErrorString(e));
    mDeviceReady = true;
}

void LatentAttentionPlugin::doEnqueue(PluginTensorDesc const* inputDesc, void const* const* inputs,
    void* const* outputs, void* workspace, cudaStream_t stream)
{
    ensureDevice(); // normally done by onShapeChange already
    Dims const& q = inputDesc[kIN_Q].dims;
    LatentAttentionParams p{};
    p.dataType = kvxDType(inputDesc[kIN_Q].type);
    p.q = inputs[kIN_Q];
    p.latent = inputs[kIN_LATENT];
    p.qPositions = static_cast<int64_t const*>(inputs[kIN_Q_POSITIONS]);
    p.latentPositions = static_cast<int64_t const*>(inputs[kIN_LATENT_POSITIONS]);
    p.batch = static_cast<int32_t>(q.d[0]);
    p.heads = static_cast<int32_t>(q.d[1]);
    p.queries = static_cast<int32_t>(q.d[2]);
    p.slots = static_cast<int32_t>(latentSlots(inputDesc[kIN_LATENT].dims));
    p.dim = static_cast<int32_t>(q.d[3]);
    p.rank = mRank;
    p.scale = mScale;
    p.out = outputs[kOUT_OUT];
    p.workspace = workspace;
    p.latentFormat = mLatentFormat;
    p.newLatent = mNbInputs > kIN_NEW_LATENT ? inputs[kIN_NEW_LATENT] : nullptr;
    p.latentScale = mLatentFormat != kLatentFormatNone ? inputs[kIN_LATENT_SCALE] : nullptr;
    p.workspaceSize = latentAttentionWorkspaceSize(
        p.batch, p.heads, p.queries, latentAttentionTotalSlots(p), p.dim, p.rank);
    cudaError_t const e = launchLatentAttention(p, mDevice, stream);
    require(e == cudaSuccess, std::string("kernel launch failed: ") + cudaGetErrorString(e));
}

int32_t LatentAttentionPlugin::enqueue(PluginTensorDesc const* inputDesc, PluginTensorDesc const* /*outputDesc*/,
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

IPluginV3* LatentAttentionPlugin::attachToContext(IPluginResourceContext* /*context*/) noexcept
{
    return clone();
}

PluginFieldCollection const* LatentAttentionPlugin::getFieldsToSerialize() noexcept
{
    mSerialFields.clear();
    mSerialFields.emplace_back("rank", &mRank, PluginFieldType::kINT32, 1);
    mSerialFields.emplace_back("scale", &mScale, PluginFieldType::kFLOAT32, 1);
    if (mVersion == 2)
    {
        mSerialFields.emplace_back("latent_format", &mLatentFormat, PluginFieldType::kINT32, 1);
    }
    mSerialFc.nbFields = static_cast<int32_t>(mSerialFields.size());
    mSerialFc.fields = mSerialFields.data();
    return &mSerialFc;
}

// ---------------------------------------------------------------------------------------------------------------
// Creator

LatentAttentionPluginCreator::LatentAttentionPluginCreator(int32_t version)
    : mVersion(version == 2 ? 2 : 1)
{
    mFields.emplace_back("rank", nullptr, PluginFieldType::kINT32, 1);
    mFields.emplace_back("scale", nullptr, PluginFieldType::kFLOAT32, 1);
    if (mVersion == 2)
    {
        mFields.emplace_back("latent_format", nullptr, PluginFieldType::kINT32, 1);
    }
    mFc.nbFields = static_cast<int32_t>(mFields.size());
    mFc.fields = mFields.data();
}

char const* LatentAttentionPluginCreator::getPluginName() const noexcept
{
    return LatentAttentionPlugin::kNAME;
}

char const* LatentAttentionPluginCreator::getPluginVersion() const noexcept
{
    return versionString(mVersion);
}

char const* LatentAttentionPluginCreator::getPluginNamespace() const noexcept
{
    return kPLUGIN_NAMESPACE;
}

PluginFieldCollection const* LatentAttentionPluginCreator::getFieldNames() noexcept
{
    return &mFc;
}

LatentAttentionAttributes LatentAttentionPluginCreator::parse(PluginFieldCollection const* fc, int32_t version)
{
    require(fc != nullptr, "no attributes given; LatentAttention needs rank and scale");
    bool haveRank = false;
    bool haveScale = false;
    LatentAttentionAttributes a{0, 0.0F, kLatentFormatNone};
    for (int32_t i = 0; i < fc->nbFields; ++i)
    {
        PluginField const& f = fc->fields[i];
        if (fieldIs(f, "rank"))
        {
            int64_t const r = fieldInt(f);
            require(r >= 1 && r <= kLatentAttentionMaxRank, "attribute rank = " + std::to_string(r)
                    + " is outside [1, " + std::to_string(kLatentAttentionMaxRank) + "]");
            a.rank = static_cast<int32_t>(r);
            haveRank = true;
        }
        else if (fieldIs(f, "scale"))
        {
            a.scale = fieldFloat(f);
            require(std::isfinite(a.scale) && a.scale > 0.0F, "attribute scale must be a positive finite float");
            haveScale = true;
        }
        else if (fieldIs(f, "latent_format"))
        {
            int64_t const fmt = fieldInt(f);
            requireFormat(fmt);
            require(version == 2 || fmt == kLatentFormatNone,
                "attribute latent_format = " + std::to_string(fmt) + " needs plugin_version \"2\"");
            a.latentFormat = static_cast<int32_t>(fmt);
        }
    }
    require(haveRank, "attribute rank is missing (the latent value width R)");
    require(haveScale, "attribute scale is missing (the softmax scale, 1/sqrt(d_nope + d_rope))");
    return a;
}

IPluginV3* LatentAttentionPluginCreator::createPlugin(
    char const* /*name*/, PluginFieldCollection const* fc, TensorRTPhase /*phase*/) noexcept
{
    try
    {
        LatentAttentionAttributes const a = parse(fc, mVersion);
        return std::make_unique<LatentAttentionPlugin>(a.rank, a.scale, mVersion, a.latentFormat).release();
    }
    catch (std::exception const& e)
    {
        fail(e);
    }
    return nullptr;
}

} // namespace kvexport
