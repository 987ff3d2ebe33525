// SPDX-License-Identifier: Apache-2.0
// TensorRT IPluginV3 implementation of the kvexport LatentAttention op (docs/custom_ops.md). Plugin version "1": the
// four version-1 inputs; version "2": also new_latent, latent_scale and the latent_format attribute (quantized cache).
#pragma once

#include "../common/kvxDevice.h"
#include "NvInferRuntime.h"

#include <cstdint>
#include <vector>

namespace kvexport
{

class LatentAttentionPlugin : public nvinfer1::IPluginV3,
                              public nvinfer1::IPluginV3OneCore,
                              public nvinfer1::IPluginV3OneBuild,
                              public nvinfer1::IPluginV3OneRuntime
{
public:
    static constexpr char const* kNAME = "LatentAttention";

    // inputs
    static constexpr int32_t kIN_Q = 0;                //!< (B, Hq, T, R + Dr) float
    static constexpr int32_t kIN_LATENT = 1;           //!< (B, S, R + Dr) as q, or uint8 codes (latent_format 1 / 2)
    static constexpr int32_t kIN_Q_POSITIONS = 2;      //!< (B, T) int64
    static constexpr int32_t kIN_LATENT_POSITIONS = 3; //!< (B, S) int64
    static constexpr int32_t kIN_NEW_LATENT = 4;       //!< version 2, optional: (B, T, R + Dr) as q
    static constexpr int32_t kIN_LATENT_SCALE = 5;     //!< version 2, optional (needs new_latent): (B, S) float16
    static constexpr int32_t kNB_INPUTS = 4;           //!< version 1
    static constexpr int32_t kMAX_INPUTS = 6;          //!< version 2
    // outputs
    static constexpr int32_t kOUT_OUT = 0; //!< (B, Hq, T, R) as q
    static constexpr int32_t kNB_OUTPUTS = 1;

    //! version 1 or 2 (the plugin_version of the node); latentFormat 0 / 1 / 2 (version 2 only).
    LatentAttentionPlugin(int32_t rank, float scale, int32_t version = 1, int32_t latentFormat = 0);
    LatentAttentionPlugin(LatentAttentionPlugin const& other);
    ~LatentAttentionPlugin() override = default;

    // IPluginV3
    nvinfer1::IPluginCapability* getCapabilityInterface(nvinfer1::PluginCapabilityType type) noexcept override;
    nvinfer1::IPluginV3* clone() noexcept override;

    // IPluginV3OneCore
    char const* getPluginName() const noexcept override;
    char const* getPluginVersion() const noexcept override;
    char const* getPluginNamespace() const noexcept override;

    // IPluginV3OneBuild
    int32_t configurePlugin(nvinfer1::DynamicPluginTensorDesc const* in, int32_t nbInputs,
        nvinfer1::DynamicPluginTensorDesc const* out, int32_t nbOutputs) noexcept override;
    int32_t getOutputDataTypes(nvinfer1::DataType* outputTypes, int32_t nbOutputs,
        nvinfer1::DataType const* inputTypes, int32_t nbInputs) const noexcept override;
    int32_t getOutputShapes(nvinfer1::DimsExprs const* inputs, int32_t nbInputs,
        nvinfer1::DimsExprs const* shapeInputs, int32_t nbShapeInputs, nvinfer1::DimsExprs* outputs,
        int32_t nbOutputs, nvinfer1::IExprBuilder& exprBuilder) noexcept override;
    bool supportsFormatCombination(int32_t pos, nvinfer1::DynamicPluginTensorDesc const* inOut, int32_t nbInputs,
        int32_t nbOutputs) noexcept override;
    int32_t getNbOutputs() const noexcept override;
    size_t getWorkspaceSize(nvinfer1::DynamicPluginTensorDesc const* inputs, int32_t nbInputs,
        nvinfer1::DynamicPluginTensorDesc const* outputs, int32_t nbOutputs) const noexcept override;

    // IPluginV3OneRuntime
    int32_t onShapeChange(nvinfer1::PluginTensorDesc const* in, int32_t nbInputs,
        nvinfer1::PluginTensorDesc const* out, int32_t nbOutputs) noexcept override;
    int32_t enqueue(nvinfer1::PluginTensorDesc const* inputDesc, nvinfer1::PluginTensorDesc const* outputDesc,
        void const* const* inputs, void* const* outputs, void* workspace, cudaStream_t stream) noexcept override;
    nvinfer1::IPluginV3* attachToContext(nvinfer1::IPluginResourceContext* context) noexcept override;
    nvinfer1::PluginFieldCollection const* getFieldsToSerialize() noexcept override;

    //! Whether a node of this plugin may have `nbInputs` inputs: 4 (version 1); version 2: 4 or 5 for a float cache,
    //! 6 (with latent_scale) for a quantized one, 6 for a float one too (the scale is then ignored).
    bool acceptsInputs(int32_t nbInputs) const noexcept;

private:
    void requireInputs(int32_t nbInputs) const;
    void checkShapes(nvinfer1::PluginTensorDesc const* in, int32_t nbInputs) const;
    //! Queries the device attributes and prepares the kernels, once per plugin instance (runtime phase).
    void ensureDevice();
    void doEnqueue(nvinfer1::PluginTensorDesc const* inputDesc, void const* const* inputs, void* const* outputs,
        void* workspace, cudaStream_t stream);

    int32_t mRank;
    float mScale;
    int32_t mVersion;
    int32_t mLatentFormat;
    int32_t mNbInputs{kNB_INPUTS}; //!< of the node, recorded by configurePlugin / onShapeChange for enqueue
    KvxDeviceInfo mDevice{};
    bool mDeviceReady{false};
    std::vector<nvinfer1::PluginField> mSerialFields;
    nvinfer1::PluginFieldCollection mSerialFc{};
};

//! Attributes of LatentAttention, parsed from a field collection.
struct LatentAttentionAttributes
{
    int32_t rank;
    float scale;
    int32_t latentFormat; //!< 0 unless version 2 sets it
};

//! Creator of one plugin version; its fields `rank` (int), `scale` (float) and, version 2, `latent_format` (int) are
//! the ONNX attributes of the same names. Both versions are registered (getCreators).
class LatentAttentionPluginCreator : public nvinfer1::IPluginCreatorV3One
{
public:
    explicit LatentAttentionPluginCreator(int32_t version = 1);
    ~LatentAttentionPluginCreator() override = default;

    char const* getPluginName() const noexcept override;
    char const* getPluginVersion() const noexcept override;
    char const* getPluginNamespace() const noexcept override;
    nvinfer1::PluginFieldCollection const* getFieldNames() noexcept override;
    nvinfer1::IPluginV3* createPlugin(char const* name, nvinfer1::PluginFieldCollection const* fc,
        nvinfer1::TensorRTPhase phase) noexcept override;

    //! Parses rank, scale and (version 2) latent_format (throws PluginError with a one-line message); public for tests.
    static LatentAttentionAttributes parse(nvinfer1::PluginFieldCollection const* fc, int32_t version = 1);

private:
    int32_t mVersion;
    std::vector<nvinfer1::PluginField> mFields;
    nvinfer1::PluginFieldCollection mFc{};
};

} // namespace kvexport
