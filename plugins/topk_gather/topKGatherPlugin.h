// SPDX-License-Identifier: Apache-2.0
// TensorRT IPluginV3 implementation of the kvexport TopKGather op (docs/custom_ops.md).
#pragma once

#include "NvInferRuntime.h"

#include <cstdint>
#include <string>
#include <vector>

namespace kvexport
{

class TopKGatherPlugin : public nvinfer1::IPluginV3,
                         public nvinfer1::IPluginV3OneCore,
                         public nvinfer1::IPluginV3OneBuild,
                         public nvinfer1::IPluginV3OneRuntime
{
public:
    static constexpr char const* kNAME = "TopKGather";

    // inputs
    static constexpr int32_t kIN_SCORES = 0;    //!< (B, H, S) float32 (every build mode: the selection is exact)
    static constexpr int32_t kIN_KEYS = 1;      //!< (B, H, S, Dk) float
    static constexpr int32_t kIN_VALUES = 2;    //!< (B, H, S, Dv) as keys
    static constexpr int32_t kIN_POSITIONS = 3; //!< (B, H, S) int64
    static constexpr int32_t kNB_INPUTS = 4;
    // outputs
    static constexpr int32_t kOUT_KEYS = 0;      //!< (B, H, k, Dk)
    static constexpr int32_t kOUT_VALUES = 1;    //!< (B, H, k, Dv)
    static constexpr int32_t kOUT_POSITIONS = 2; //!< (B, H, k) int64
    static constexpr int32_t kOUT_INDICES = 3;   //!< (B, H, k) int64, ascending
    static constexpr int32_t kNB_OUTPUTS = 4;

    explicit TopKGatherPlugin(int32_t k);
    TopKGatherPlugin(TopKGatherPlugin const&) = default;
    ~TopKGatherPlugin() override = default;

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

    int32_t k() const noexcept
    {
        return mK;
    }

private:
    void checkShapes(nvinfer1::PluginTensorDesc const* in, int32_t nbInputs) const;
    void doEnqueue(nvinfer1::PluginTensorDesc const* inputDesc, void const* const* inputs, void* const* outputs,
        void* workspace, cudaStream_t stream) const;

    int32_t mK;
    std::vector<nvinfer1::PluginField> mSerialFields;
    nvinfer1::PluginFieldCollection mSerialFc{};
};

//! Creator; its one field `k` is the ONNX attribute of the same name.
class TopKGatherPluginCreator : public nvinfer1::IPluginCreatorV3One
{
public:
    TopKGatherPluginCreator();
    ~TopKGatherPluginCreator() override = default;

    char const* getPluginName() const noexcept override;
    char const* getPluginVersion() const noexcept override;
    char const* getPluginNamespace() const noexcept override;
    nvinfer1::PluginFieldCollection const* getFieldNames() noexcept override;
    nvinfer1::IPluginV3* createPlugin(char const* name, nvinfer1::PluginFieldCollection const* fc,
        nvinfer1::TensorRTPhase phase) noexcept override;

    //! Parses the fields into k (throws PluginError with a one-line message); public for tests.
    static int32_t parseK(nvinfer1::PluginFieldCollection const* fc);

private:
    std::vector<nvinfer1::PluginField> mFields;
    nvinfer1::PluginFieldCollection mFc{};
};

} // namespace kvexport
