// SPDX-License-Identifier: Apache-2.0
// Host-side checks of the kvexport plugin classes that need TensorRT's headers but no GPU and no libnvinfer:
// creator field names = ONNX attribute names, attribute parsing (types, missing, out of range), the serialization
// round trip, output types and format combinations, and the getCreators entry point. Built and run by
// tests/plugins/test_compile.py (compiled with KVEXPORT_STATIC_REGISTRATION=0, so nothing calls into libnvinfer).
#include "../../plugins/common/pluginUtils.h"
#include "../../plugins/latent_attention/latentAttentionPlugin.h"
#include "../../plugins/topk_gather/topKGatherPlugin.h"

#include <cstdio>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

using namespace nvinfer1;
using namespace kvexport;

extern "C" IPluginCreatorInterface* const* getCreators(int32_t& nbCreators);

namespace
{
int gFailures = 0;

void check(bool ok, char const* what)
{
    std::printf("%s %s\n", ok ? "PASS" : "FAIL", what);
    if (!ok)
    {
        ++gFailures;
    }
}

template <typename F>
bool throws(F&& f)
{
    try
    {
        f();
    }
    catch (PluginError const&)
    {
        return true;
    }
    return false;
}

std::string fieldNames(PluginFieldCollection const* fc)
{
    std::string s;
    for (int32_t i = 0; i < fc->nbFields; ++i)
    {
        s += (i ? "," : "") + std::string(fc->fields[i].name);
    }
    return s;
}

DynamicPluginTensorDesc desc(DataType t)
{
    DynamicPluginTensorDesc d{};
    d.desc.type = t;
    d.desc.format = TensorFormat::kLINEAR;
    return d;
}

//! Prints "DECLARE <plugin> <position> <type>" for every type supportsFormatCombination accepts at each position,
//! the other positions held at `base`; tests/plugins/test_compile.py compares this with op_support.PLUGIN_IO.
void declare(char const* plugin, IPluginV3OneBuild* build, std::vector<DataType> const& base, int32_t nbIn)
{
    struct Named
    {
        DataType t;
        char const* name;
    } const types[] = {{DataType::kFLOAT, "f32"}, {DataType::kHALF, "f16"}, {DataType::kBF16, "bf16"},
        {DataType::kINT32, "i32"}, {DataType::kINT64, "i64"}, {DataType::kBOOL, "bool"}, {DataType::kUINT8, "u8"},
        {DataType::kINT8, "i8"}};
    int32_t const n = static_cast<int32_t>(base.size());
    for (int32_t pos = 0; pos < n; ++pos)
    {
        for (Named const& t : types)
        {
            std::vector<DynamicPluginTensorDesc> io;
            for (int32_t i = 0; i < n; ++i)
            {
                io.push_back(desc(i == pos ? t.t : base[static_cast<size_t>(i)]));
            }
            if (build->supportsFormatCombination(pos, io.data(), nbIn, n - nbIn))
            {
                std::printf("DECLARE %s %d %s\n", plugin, pos, t.name);
            }
        }
    }
}
} // namespace

int main()
{
    // ---- TopKGather creator
    TopKGatherPluginCreator tk;
    check(std::strcmp(tk.getPluginName(), "TopKGather") == 0, "TopKGather name");
    check(std::strcmp(tk.getPluginNamespace(), "kvexport") == 0, "TopKGather namespace kvexport");
    check(std::strcmp(tk.getPluginVersion(), "1") == 0, "TopKGather version 1");
    check(fieldNames(tk.getFieldNames()) == "k", "TopKGather fields = k");

    int32_t k32 = 7;
    int64_t k64 = 9;
    PluginField f32("k", &k32, PluginFieldType::kINT32, 1);
    PluginField f64("k", &k64, PluginFieldType::kINT64, 1);
    PluginFieldCollection c32{1, &f32};
    PluginFieldCollection c64{1, &f64};
    check(TopKGatherPluginCreator::parseK(&c32) == 7, "k from kINT32");
    check(TopKGatherPluginCreator::parseK(&c64) == 9, "k from kINT64");
    PluginFieldCollection none{0, nullptr};
    check(throws([&] { TopKGatherPluginCreator::parseK(&none); }), "missing k rejected");
    int32_t k0 = 0;
    PluginField fz("k", &k0, PluginFieldType::kINT32, 1);
    PluginFieldCollection cz{1, &fz};
    check(throws([&] { TopKGatherPluginCreator::parseK(&cz); }), "k = 0 rejected");
    float kf = 3.0F;
    PluginField ff("k", &kf, PluginFieldType::kFLOAT32, 1);
    PluginFieldCollection cf{1, &ff};
    check(throws([&] { TopKGatherPluginCreator::parseK(&cf); }), "float k rejected");
    check(tk.createPlugin("x", &cz, TensorRTPhase::kBUILD) == nullptr, "createPlugin(k = 0) returns null");

    std::unique_ptr<IPluginV3> p(tk.createPlugin("x", &c32, TensorRTPhase::kBUILD));
    check(p != nullptr, "createPlugin(k = 7)");
    auto* core = static_cast<IPluginV3OneCore*>(p->getCapabilityInterface(PluginCapabilityType::kCORE));
    auto* build = static_cast<IPluginV3OneBuild*>(p->getCapabilityInterface(PluginCapabilityType::kBUILD));
    auto* runtime = static_cast<IPluginV3OneRuntime*>(p->getCapabilityInterface(PluginCapabilityType::kRUNTIME));
    check(std::strcmp(core->getPluginName(), "TopKGather") == 0, "core capability");
    check(build->getNbOutputs() == 4, "TopKGather has 4 outputs");
    PluginFieldCollection const* ser = runtime->getFieldsToSerialize();
    std::unique_ptr<IPluginV3> p2(tk.createPlugin("x", ser, TensorRTPhase::kRUNTIME));
    check(p2 && static_cast<TopKGatherPlugin*>(p2.get())->k() == 7, "serialize round trip keeps k");
    std::unique_ptr<IPluginV3> p3(p->clone());
    check(p3 && static_cast<TopKGatherPlugin*>(p3.get())->k() == 7, "clone keeps k");

    DataType in[4] = {DataType::kFLOAT, DataType::kHALF, DataType::kHALF, DataType::kINT64};
    DataType out[4];
    check(build->getOutputDataTypes(out, 4, in, 4) == 0 && out[0] == DataType::kHALF && out[1] == DataType::kHALF
            && out[2] == DataType::kINT64 && out[3] == DataType::kINT64,
        "TopKGather output types");
    std::vector<DynamicPluginTensorDesc> io = {desc(DataType::kFLOAT), desc(DataType::kHALF), desc(DataType::kHALF),
        desc(DataType::kINT64), desc(DataType::kHALF), desc(DataType::kHALF), desc(DataType::kINT64),
        desc(DataType::kINT64)};
    bool all = true;
    for (int32_t pos = 0; pos < 8; ++pos)
    {
        all = all && build->supportsFormatCombination(pos, io.data(), 4, 4);
    }
    check(all, "TopKGather accepts fp32 scores + fp16 keys/values + int64");
    io[0] = desc(DataType::kHALF);
    check(!build->supportsFormatCombination(0, io.data(), 4, 4), "TopKGather rejects fp16 scores (FP32 only)");
    io[0] = desc(DataType::kBF16);
    check(!build->supportsFormatCombination(0, io.data(), 4, 4), "TopKGather rejects bf16 scores (FP32 only)");
    io[0] = desc(DataType::kFLOAT);
    int32_t bigK = 1 << 20;
    PluginField fb("k", &bigK, PluginFieldType::kINT32, 1);
    PluginFieldCollection cb{1, &fb};
    check(TopKGatherPluginCreator::parseK(&cb) == (1 << 20), "k above the old 8192 limit accepted");
    io[3] = desc(DataType::kINT32);
    check(!build->supportsFormatCombination(3, io.data(), 4, 4), "TopKGather rejects int32 positions");
    io[2] = desc(DataType::kFLOAT);
    check(!build->supportsFormatCombination(2, io.data(), 4, 4), "TopKGather rejects values typed unlike keys");
    io[1] = desc(DataType::kINT8);
    check(!build->supportsFormatCombination(1, io.data(), 4, 4), "TopKGather rejects int8 keys");
    io[1] = desc(DataType::kBF16);
    check(build->supportsFormatCombination(1, io.data(), 4, 4) == (KVEXPORT_ENABLE_BF16 != 0), "TopKGather bf16 keys");

    // ---- LatentAttention creator
    LatentAttentionPluginCreator la;
    check(std::strcmp(la.getPluginName(), "LatentAttention") == 0, "LatentAttention name");
    check(std::strcmp(la.getPluginNamespace(), "kvexport") == 0, "LatentAttention namespace kvexport");
    check(fieldNames(la.getFieldNames()) == "rank,scale", "LatentAttention fields = rank,scale");
    int32_t rank = 64;
    float scale = 0.125F;
    double scale64 = 0.25;
    PluginField lf[2] = {PluginField("rank", &rank, PluginFieldType::kINT32, 1),
        PluginField("scale", &scale, PluginFieldType::kFLOAT32, 1)};
    PluginFieldCollection lc{2, lf};
    LatentAttentionAttributes a = LatentAttentionPluginCreator::parse(&lc);
    check(a.rank == 64 && a.scale == 0.125F, "rank/scale parsed");
    PluginField lf64[2] = {PluginField("rank", &rank, PluginFieldType::kINT32, 1),
        PluginField("scale", &scale64, PluginFieldType::kFLOAT64, 1)};
    PluginFieldCollection lc64{2, lf64};
    check(LatentAttentionPluginCreator::parse(&lc64).scale == 0.25F, "scale from kFLOAT64");
    PluginFieldCollection lcRankOnly{1, lf};
    check(throws([&] { LatentAttentionPluginCreator::parse(&lcRankOnly); }), "missing scale rejected");
    int32_t bigRank = 4096;
    PluginField lfBig[2] = {PluginField("rank", &bigRank, PluginFieldType::kINT32, 1),
        PluginField("scale", &scale, PluginFieldType::kFLOAT32, 1)};
    PluginFieldCollection lcBig{2, lfBig};
    check(throws([&] { LatentAttentionPluginCreator::parse(&lcBig); }), "rank > 512 rejected");
    float negScale = -1.0F;
    PluginField lfNeg[2] = {PluginField("rank", &rank, PluginFieldType::kINT32, 1),
        PluginField("scale", &negScale, PluginFieldType::kFLOAT32, 1)};
    PluginFieldCollection lcNeg{2, lfNeg};
    check(throws([&] { LatentAttentionPluginCreator::parse(&lcNeg); }), "negative scale rejected");

    std::unique_ptr<IPluginV3> q(la.createPlugin("y", &lc, TensorRTPhase::kBUILD));
    check(q != nullptr, "createPlugin(rank 64, scale 0.125)");
    auto* qbuild = static_cast<IPluginV3OneBuild*>(q->getCapabilityInterface(PluginCapabilityType::kBUILD));
    auto* qrt = static_cast<IPluginV3OneRuntime*>(q->getCapabilityInterface(PluginCapabilityType::kRUNTIME));
    PluginFieldCollection const* qser = qrt->getFieldsToSerialize();
    LatentAttentionAttributes b = LatentAttentionPluginCreator::parse(qser);
    check(b.rank == 64 && b.scale == 0.125F, "serialize round trip keeps rank/scale");
    check(qbuild->getNbOutputs() == 1, "LatentAttention has 1 output");
    DataType lin[4] = {DataType::kHALF, DataType::kHALF, DataType::kINT64, DataType::kINT64};
    DataType lout[1];
    check(qbuild->getOutputDataTypes(lout, 1, lin, 4) == 0 && lout[0] == DataType::kHALF,
        "LatentAttention output type (out as q)");
    std::vector<DynamicPluginTensorDesc> lio = {desc(DataType::kHALF), desc(DataType::kHALF), desc(DataType::kINT64),
        desc(DataType::kINT64), desc(DataType::kHALF)};
    all = true;
    for (int32_t pos = 0; pos < 5; ++pos)
    {
        all = all && qbuild->supportsFormatCombination(pos, lio.data(), 4, 1);
    }
    check(all, "LatentAttention accepts fp16 q/latent/out + int64 positions");
    check(!qbuild->supportsFormatCombination(0, lio.data(), 4, 2), "LatentAttention refuses a second output");
    lio[4] = desc(DataType::kFLOAT);
    check(!qbuild->supportsFormatCombination(4, lio.data(), 4, 1), "LatentAttention out typed like q");
    lio[1] = desc(DataType::kFLOAT);
    check(!qbuild->supportsFormatCombination(1, lio.data(), 4, 1), "LatentAttention latent typed like q");

    check(!qbuild->supportsFormatCombination(0, lio.data(), 5, 1), "LatentAttention version 1 refuses 5 inputs");

    // ---- LatentAttention plugin_version "2": new_latent, latent_scale, latent_format (issue 18)
    LatentAttentionPluginCreator la2(2);
    check(std::strcmp(la2.getPluginVersion(), "2") == 0 && std::strcmp(la.getPluginVersion(), "1") == 0,
        "LatentAttention creators of versions 1 and 2");
    check(fieldNames(la2.getFieldNames()) == "rank,scale,latent_format", "version 2 fields add latent_format");
    int32_t fmt8 = 1;
    int32_t fmtBad = 3;
    PluginField lf2[3] = {PluginField("rank", &rank, PluginFieldType::kINT32, 1),
        PluginField("scale", &scale, PluginFieldType::kFLOAT32, 1),
        PluginField("latent_format", &fmt8, PluginFieldType::kINT32, 1)};
    PluginFieldCollection lc2{3, lf2};
    check(LatentAttentionPluginCreator::parse(&lc2, 2).latentFormat == 1, "latent_format parsed (version 2)");
    check(throws([&] { LatentAttentionPluginCreator::parse(&lc2, 1); }), "latent_format refused by version 1");
    PluginField lf2Bad[3] = {lf2[0], lf2[1], PluginField("latent_format", &fmtBad, PluginFieldType::kINT32, 1)};
    PluginFieldCollection lc2Bad{3, lf2Bad};
    check(throws([&] { LatentAttentionPluginCreator::parse(&lc2Bad, 2); }), "latent_format 3 rejected");
    std::unique_ptr<IPluginV3> q2(la2.createPlugin("z", &lc2, TensorRTPhase::kBUILD));
    check(q2 != nullptr, "createPlugin(version 2, int8)");
    if (q2 != nullptr)
    {
        auto* core2 = static_cast<IPluginV3OneCore*>(q2->getCapabilityInterface(PluginCapabilityType::kCORE));
        auto* b2 = static_cast<IPluginV3OneBuild*>(q2->getCapabilityInterface(PluginCapabilityType::kBUILD));
        auto* rt2 = static_cast<IPluginV3OneRuntime*>(q2->getCapabilityInterface(PluginCapabilityType::kRUNTIME));
        check(std::strcmp(core2->getPluginVersion(), "2") == 0, "version 2 plugin reports plugin_version 2");
        LatentAttentionAttributes const s2 = LatentAttentionPluginCreator::parse(rt2->getFieldsToSerialize(), 2);
        check(s2.rank == 64 && s2.latentFormat == 1, "version 2 serialize round trip keeps latent_format");
        std::vector<DynamicPluginTensorDesc> io2 = {desc(DataType::kHALF), desc(DataType::kUINT8),
            desc(DataType::kINT64), desc(DataType::kINT64), desc(DataType::kHALF), desc(DataType::kHALF),
            desc(DataType::kHALF)};
        bool all2 = true;
        for (int32_t pos = 0; pos < 7; ++pos)
        {
            all2 = all2 && b2->supportsFormatCombination(pos, io2.data(), 6, 1);
        }
        check(all2, "version 2 int8: fp16 q, uint8 latent, fp16 new_latent / latent_scale / out");
        check(!b2->supportsFormatCombination(0, io2.data(), 5, 1), "quantized latent needs latent_scale (6 inputs)");
        io2[1] = desc(DataType::kHALF);
        check(!b2->supportsFormatCombination(1, io2.data(), 6, 1), "quantized latent must be uint8");
        io2[1] = desc(DataType::kUINT8);
        io2[5] = desc(DataType::kFLOAT);
        check(!b2->supportsFormatCombination(5, io2.data(), 6, 1), "latent_scale must be float16");
        io2[5] = desc(DataType::kHALF);
        io2[4] = desc(DataType::kFLOAT);
        check(!b2->supportsFormatCombination(4, io2.data(), 6, 1), "new_latent typed like q");
        DataType in2[6] = {DataType::kBF16, DataType::kUINT8, DataType::kINT64, DataType::kINT64, DataType::kBF16,
            DataType::kHALF};
        DataType out2[1];
        check(b2->getOutputDataTypes(out2, 1, in2, 6) == 0 && out2[0] == DataType::kBF16, "version 2 out as q");
        // the latent as the exporter hands a quantized cache over: its (B, 1, S, D) buffer (no UINT8 reshape)
        auto dims = [](std::vector<int64_t> const& v) {
            Dims d{};
            d.nbDims = static_cast<int32_t>(v.size());
            for (size_t i = 0; i < v.size(); ++i)
            {
                d.d[i] = v[i];
            }
            return d;
        };
        auto shaped = [&](std::vector<int64_t> const& latent, int64_t slots) {
            std::vector<DynamicPluginTensorDesc> s = io2;
            std::vector<std::vector<int64_t>> const shapes = {{2, 8, 1, 72}, latent, {2, 1}, {2, slots}, {2, 1, 72},
                {2, slots}, {2, 8, 1, 64}};
            for (size_t i = 0; i < s.size(); ++i)
            {
                s[i].desc.dims = s[i].min = s[i].max = s[i].opt = dims(shapes[i]);
            }
            return s;
        };
        std::vector<DynamicPluginTensorDesc> flat = shaped({2, 300, 72}, 300);
        std::vector<DynamicPluginTensorDesc> head = shaped({2, 1, 300, 72}, 300);
        check(b2->configurePlugin(head.data(), 6, head.data() + 6, 1) == 0, "version 2 takes a (B, 1, S, D) latent");
        check(b2->getWorkspaceSize(head.data(), 6, head.data() + 6, 1)
                    == b2->getWorkspaceSize(flat.data(), 6, flat.data() + 6, 1)
                && b2->getWorkspaceSize(flat.data(), 6, flat.data() + 6, 1)
                    != b2->getWorkspaceSize(shaped({2, 1, 40, 72}, 40).data(), 6, flat.data() + 6, 1),
            "(B, 1, S, D) latent: S read from dimension 2 (workspace as for (B, S, D))");
        std::vector<DynamicPluginTensorDesc> wide = shaped({2, 1, 300, 64}, 300);
        check(b2->configurePlugin(wide.data(), 6, wide.data() + 6, 1) != 0, "(B, 1, S, D) latent: D must be q's");
    }
    int32_t fmt0 = 0;
    PluginField lf2f[3] = {lf2[0], lf2[1], PluginField("latent_format", &fmt0, PluginFieldType::kINT32, 1)};
    PluginFieldCollection lc2f{3, lf2f};
    std::unique_ptr<IPluginV3> q2f(la2.createPlugin("w", &lc2f, TensorRTPhase::kBUILD));
    if (q2f != nullptr)
    {
        auto* b2f = static_cast<IPluginV3OneBuild*>(q2f->getCapabilityInterface(PluginCapabilityType::kBUILD));
        std::vector<DynamicPluginTensorDesc> io2f = {desc(DataType::kHALF), desc(DataType::kHALF),
            desc(DataType::kINT64), desc(DataType::kINT64), desc(DataType::kHALF), desc(DataType::kHALF)};
        bool allf = true;
        for (int32_t pos = 0; pos < 6; ++pos)
        {
            allf = allf && b2f->supportsFormatCombination(pos, io2f.data(), 5, 1);
        }
        check(allf, "version 2 float cache + new_latent (5 inputs)");
        io2f[1] = desc(DataType::kUINT8);
        check(!b2f->supportsFormatCombination(1, io2f.data(), 5, 1), "version 2 float cache: latent typed like q");
    }
    check(q2f != nullptr, "createPlugin(version 2, float cache)");

    // ---- declared formats (compared with kvexport.tensorrt.op_support.PLUGIN_IO)
    declare("TopKGather", build,
        {DataType::kFLOAT, DataType::kHALF, DataType::kHALF, DataType::kINT64, DataType::kHALF, DataType::kHALF,
            DataType::kINT64, DataType::kINT64},
        4);
    declare("LatentAttention", qbuild,
        {DataType::kHALF, DataType::kHALF, DataType::kINT64, DataType::kINT64, DataType::kHALF}, 4);

    // ---- library entry point
    int32_t n = 0;
    IPluginCreatorInterface* const* creators = getCreators(n);
    check(n == 3 && creators != nullptr, "getCreators returns 3 creators (LatentAttention versions 1 and 2)");
    if (n == 3)
    {
        auto* c0 = static_cast<IPluginCreatorV3One*>(creators[0]);
        auto* c1 = static_cast<IPluginCreatorV3One*>(creators[1]);
        check(std::strcmp(c0->getInterfaceInfo().kind, "PLUGIN CREATOR_V3ONE") == 0, "creators are V3One");
        check(std::strcmp(c0->getPluginName(), "TopKGather") == 0
                && std::strcmp(c1->getPluginName(), "LatentAttention") == 0,
            "getCreators names");
        auto* c2 = static_cast<IPluginCreatorV3One*>(creators[2]);
        check(std::strcmp(c2->getPluginName(), "LatentAttention") == 0 && std::strcmp(c1->getPluginVersion(), "1") == 0
                && std::strcmp(c2->getPluginVersion(), "2") == 0,
            "getCreators: LatentAttention versions 1 and 2");
    }
    std::printf("%d failures\n", gFailures);
    return gFailures == 0 ? 0 : 1;
}
